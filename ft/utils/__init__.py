"""Small stdlib-only helpers shared across ft (no torch imports here)."""
