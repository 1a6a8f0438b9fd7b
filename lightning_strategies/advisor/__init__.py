"""Which strategy? Predicted step time, memory and bytes per strategy for a model on a cluster."""
