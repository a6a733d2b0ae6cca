"""userdp.experiments."""
