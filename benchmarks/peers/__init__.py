"""The peers of cachefeed in the benchmarks (mosaicml-streaming, litdata) and the plain baselines."""
