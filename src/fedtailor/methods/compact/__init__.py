"""Compact adaptation (:mod:`.adaptation`): a DP context, a server generator and a personalized model in a fixed
orthonormal coefficient subspace, with its experiment catalogue (:mod:`.catalogue`)."""
