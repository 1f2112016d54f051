"""server package of fl-secure."""
