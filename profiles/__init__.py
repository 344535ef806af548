"""YAML presets: build limits, dtype and workload shapes per model."""
