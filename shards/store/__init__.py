"""The model store: models on disk, their manifests, weight files and checksums."""
