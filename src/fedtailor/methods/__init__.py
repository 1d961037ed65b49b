"""Federated methods, one module each: compact adaptation, the parameter-sharing bases that FedLAG wraps
(FedAvg, FedProx, FedPer, FedRep, FedBABU, Ditto, FedRoD, LG-FedAvg, APFL) and the DPO methods. Each module
declares its config model and registers its builder (:mod:`fedtailor.fl.registry`); this package imports
nothing, so that the registry alone decides what is loaded."""
