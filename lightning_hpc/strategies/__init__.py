"""Lightning strategies (thin adapters over the plain-torch cores)."""
