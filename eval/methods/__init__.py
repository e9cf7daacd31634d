"""The KV-cache methods compared by the evaluation: one small class per kind (``kinds``), the named registry
(``registry``), the KIVI-like baseline cache (``kivi``) and the shared-prefill branching (``branching``)."""
