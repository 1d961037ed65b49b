"""Federated DPO of a pretrained LM: pFedDPO with FedDPO and centralized DPO as its baselines
(:mod:`.pfeddpo`, on the LM stack of :mod:`fedtailor.lm`) and the paper's experiment catalogue
(:mod:`.catalogue`)."""
