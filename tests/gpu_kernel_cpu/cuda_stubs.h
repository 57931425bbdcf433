/*
 * Just enough of CUDA for a host C++ compiler to check the GPU branch of src/gpu/kernel.cu
 * (the code NVRTC compiles: the __global__ entry points and the barrier loop) for syntax and
 * types, with `c++ -fsyntax-only -include cuda_stubs.h`. Nothing here runs.
 */
#define __CUDACC_RTC__ 1
#define __device__
#define __global__
#define __constant__
#define __shared__ static
#define __launch_bounds__(n)
struct kvwd_stub_dim3 {
    unsigned int x, y, z;
};
static kvwd_stub_dim3 threadIdx, blockIdx, blockDim;
static inline void __syncthreads() {}
