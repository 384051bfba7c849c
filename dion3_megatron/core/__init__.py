"""The math of Dion3, on tensors alone: orthogonalization (:mod:`.ortho`), the update rule
(:mod:`.rule`) and the cost model of the automatic fraction (:mod:`.cost_model`). Nothing here
communicates: the engine (:mod:`dion3_megatron.engine`) moves tensors between ranks and calls it.
"""
