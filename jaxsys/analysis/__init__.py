"""Measuring what a configuration costs: FLOPs and hardware peaks (memory and collectives from the
compiled program come with the analysis issue)."""
