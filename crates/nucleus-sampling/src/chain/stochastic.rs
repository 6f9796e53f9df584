//! Stochastic processors: XTC, mirostat v1 and v2, adaptive-p (llama.cpp).
