"""Native kernels built on first use (C++ extensions through torch.utils.cpp_extension)."""
