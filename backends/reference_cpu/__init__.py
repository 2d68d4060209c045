"""placeholder package; filled by its issue."""
