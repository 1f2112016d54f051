"""client package of fl-secure."""
