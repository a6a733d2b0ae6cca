"""userdp.privacy."""
