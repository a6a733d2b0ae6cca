"""userdp.evaluation."""
