"""Lightning strategies: thin adapters over the plain-torch cores; each module registers its name at import."""
