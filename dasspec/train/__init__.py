"""``dasspec train``: the bundled model's recipe."""
