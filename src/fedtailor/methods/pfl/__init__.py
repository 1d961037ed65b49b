"""Personalized FL by parameter sharing: the common local-training method (:mod:`.local`), one module per base
(FedAvg, FedProx, FedPer, FedRep, FedBABU, Ditto, FedRoD, LG-FedAvg, APFL), the FedLAG wrapper (:mod:`.fedlag`)
and the experiment catalogue of the FedLAG paper (:mod:`.catalogue`)."""
