"""privacy package of fl-secure."""
