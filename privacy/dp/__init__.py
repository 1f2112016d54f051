"""Differential privacy: noise, accountants, calibration, client-level DP and DP-SGD."""
