"""Multi-agent training: per-agent views with parameter sharing, per-agent generation, credit assignment."""
