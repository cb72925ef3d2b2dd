"""Lightning strategies of lightning_hpc (each registers its name at import)."""
