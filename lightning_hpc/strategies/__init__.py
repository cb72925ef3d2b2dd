"""Lightning strategies of lightning_hpc (each module registers its name at import)."""
