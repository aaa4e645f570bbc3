"""Storage tiers behind one small protocol: device (tracked), RAM, SSD."""
