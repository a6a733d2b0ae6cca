"""userdp.training."""
