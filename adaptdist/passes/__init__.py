"""Graph passes over the joint forward+backward graph. See README.md for the invariants every pass keeps."""
