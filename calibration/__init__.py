"""Recipes shipped with shardcal (``recipes/*.toml``) and calibration-data helpers."""
