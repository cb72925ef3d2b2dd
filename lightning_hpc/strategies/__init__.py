"""Lightning strategies; each module registers its name with Lightning at import."""
