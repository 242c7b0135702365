"""Storage tiers: where snapshots are kept."""
