"""Circuit discovery scored against circuits known by construction (compiled RASP programs, MIB-style metrics)."""
