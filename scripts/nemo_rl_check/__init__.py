"""Helpers for scripts/check_nemo_rl.py: NeMo-RL's own code, imported unmodified from a checkout, run against gym-bridge."""
