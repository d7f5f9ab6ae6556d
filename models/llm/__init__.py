"""The language-model layer: one async client over configurable backends, prompts and telemetry."""
