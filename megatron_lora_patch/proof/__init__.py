"""The proof layer: the CPU testbed (launcher, topologies, models, driver) and the oracle built on it
(docs/architecture.md section 8). The product (registry, patches, LoRA library) never imports it."""
