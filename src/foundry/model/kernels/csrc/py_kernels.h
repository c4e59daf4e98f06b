/* What the Python interface's files share (module.c, py_ops.c, py_step.c, py_sample.c): each family
 * of bindings is its own method table, added to the module by PyInit__kernels (module.c). */

#ifndef FOUNDRY_PY_KERNELS_H
#define FOUNDRY_PY_KERNELS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kernels.h"

extern PyMethodDef ops_methods[];    /* py_ops.c: the products and the decode operations */
extern PyMethodDef step_methods[];   /* py_step.c: the one-token step */
extern PyMethodDef sample_methods[]; /* py_sample.c: the next token of rows of logits */

/* A buffer of one call of the decode operations below: it must hold exactly `need` bytes. */
static inline int fits(const char *what, const Py_buffer *b, Py_ssize_t need) {
    if (need < 0 || b->len != need) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, expected %zd", what, b->len, need);
        return 0;
    }
    return 1;
}

#define RELEASE_AND_RETURN(result, ...)                                                            \
    do {                                                                                           \
        Py_buffer *bufs_[] = {__VA_ARGS__};                                                        \
        for (size_t i_ = 0; i_ < sizeof bufs_ / sizeof bufs_[0]; i_++)                             \
            PyBuffer_Release(bufs_[i_]);                                                           \
        return result;                                                                             \
    } while (0)

#endif
