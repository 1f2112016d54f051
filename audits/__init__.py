"""audits package of fl-secure."""
