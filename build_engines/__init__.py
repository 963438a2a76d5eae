"""Engine build: checkpoints + search results -> a validated engine directory."""
