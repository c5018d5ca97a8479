"""The golden builders, by section: each module's functions build the goldens they are named
after (registry.py registers them; tests/golden/generate.py and generate_train.py write them)."""
