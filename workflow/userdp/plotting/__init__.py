"""userdp.plotting."""
