"""NeuronX Distributed compatibility package."""
