"""Training under the nine objectives of Kornblith et al. (2021). Uses torch."""
