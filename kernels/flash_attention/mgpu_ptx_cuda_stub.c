/* A stand-in libcuda.so.1 for mgpu_ptx.py: just enough of the CUDA driver API for the CUDA
 * plugin's MosaicGpuCompile to run its MLIR -> PTX -> ptxas pipeline on a host without a GPU.
 * It reports one sm_90 device (an H100), accepts any module and launches nothing.
 * Built by mgpu_ptx.py: cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o libcuda.so.1 this.c
 * MGPU_PTX_STUB_LOG=1 prints each call (to see what a newer plugin asks for). */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
enum { CC_MAJOR = 75, CC_MINOR = 76 }; /* CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_* */

static int handle; /* the address stands for every context, module and function */

static void note(const char *name, int arg) {
  if (getenv("MGPU_PTX_STUB_LOG")) fprintf(stderr, "mgpu_ptx stub: %s %d\n", name, arg);
}

CUresult cuInit(unsigned flags) { note("cuInit", (int)flags); return 0; }
CUresult cuDriverGetVersion(int *v) { note("cuDriverGetVersion", 0); *v = 13000; return 0; }
CUresult cuDeviceGetCount(int *n) { note("cuDeviceGetCount", 0); *n = 1; return 0; }
CUresult cuDeviceGet(int *dev, int ordinal) { note("cuDeviceGet", ordinal); *dev = 0; return 0; }
CUresult cuDeviceGetName(char *name, int len, int dev) {
  note("cuDeviceGetName", dev);
  strncpy(name, "NVIDIA H100 80GB HBM3", (size_t)len);
  return 0;
}
CUresult cuDeviceGetAttribute(int *v, int attr, int dev) {
  note("cuDeviceGetAttribute", attr);
  *v = attr == CC_MAJOR ? 9 : 0; /* minor and everything else: 0 */
  return 0;
}
CUresult cuCtxGetCurrent(void **ctx) { note("cuCtxGetCurrent", 0); *ctx = &handle; return 0; }
CUresult cuCtxGetDevice(int *dev) { note("cuCtxGetDevice", 0); *dev = 0; return 0; }
CUresult cuCtxPushCurrent(void *ctx) { note("cuCtxPushCurrent", 0); return 0; }
CUresult cuCtxPopCurrent(void **ctx) { note("cuCtxPopCurrent", 0); if (ctx) *ctx = &handle; return 0; }
CUresult cuCtxSynchronize(void) { note("cuCtxSynchronize", 0); return 0; }
CUresult cuGetErrorString(CUresult e, const char **s) { note("cuGetErrorString", e); *s = "mgpu_ptx stub"; return 0; }
CUresult cuGetErrorName(CUresult e, const char **s) { note("cuGetErrorName", e); *s = "MGPU_PTX_STUB"; return 0; }
CUresult cuModuleLoadData(void **mod, const void *image) { note("cuModuleLoadData", 0); *mod = &handle; return 0; }
CUresult cuModuleLoadDataEx(void **mod, const void *image, unsigned n, void *opts, void **vals) {
  note("cuModuleLoadDataEx", (int)n);
  *mod = &handle;
  return 0;
}
CUresult cuModuleGetFunction(void **fn, void *mod, const char *name) { note("cuModuleGetFunction", 0); *fn = &handle; return 0; }
CUresult cuModuleGetGlobal(void **ptr, size_t *bytes, void *mod, const char *name) {
  note("cuModuleGetGlobal", 0);
  if (ptr) *ptr = NULL;
  if (bytes) *bytes = 0;
  return 0;
}
CUresult cuModuleUnload(void *mod) { note("cuModuleUnload", 0); return 0; }
CUresult cuFuncSetAttribute(void *fn, int attr, int v) { note("cuFuncSetAttribute", attr); return 0; }
CUresult cuFuncGetAttribute(int *v, int attr, void *fn) { note("cuFuncGetAttribute", attr); *v = 0; return 0; }
