/* The Python module these kernels are built as (localllm._native), so the package build
 * compiles and installs them like any extension. Python calls them through ctypes. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "localllm_native.h"

int lm_abi_version(void) { return LM_ABI_VERSION; }

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native",
                                    "localllm's native kernels; called through ctypes.", -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
