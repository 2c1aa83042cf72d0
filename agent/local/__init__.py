"""What this device is and has: configuration, files, identity, the capacity probe, events, metrics, the process's lifecycle and environment."""
