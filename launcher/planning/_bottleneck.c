/* The bisection on a long chain's bottleneck, compiled: launcher/planning/bottleneck_fill.py's
 * bottleneck_bisect_python, the same arithmetic in the same order on the same doubles (bisect_right
 * on prefix sums, the midpoint of the interval), so the cuts agree for finite numbers (a profile
 * holds no other: profile_file.py); tests/planning/test_compiled_cut_loops.py compares them. On the
 * 256-node planning bench this loop was a quarter of the time. Built as an optional extension
 * (setup.py): where it cannot be built, bottleneck_fill.py keeps its Python loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_py_numbers.h"

#define NUMBERS "a bottleneck fill's" /* as TypeErrors name them */

/* A list of n + 1 numbers into out[0..n]. */
static int read_prefix(PyObject *list, Py_ssize_t n, double *out) {
    if (!PyList_Check(list) || PyList_GET_SIZE(list) != n + 1) {
        PyErr_SetString(PyExc_TypeError, "a prefix is a list of one more number than there are layers");
        return -1;
    }
    for (Py_ssize_t i = 0; i <= n; i++)
        if (as_double(PyList_GET_ITEM(list, i), &out[i], NUMBERS) < 0) return -1;
    return 0;
}

/* Python's bisect.bisect_right(a[0..n], x): the first index whose value is above x. */
static Py_ssize_t bisect_right(const double *a, Py_ssize_t n, double x) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (x < a[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

typedef struct {
    double *acc, *mem, capacity, link;
    Py_ssize_t last;
} Stage;

/* fill(limit): each stage's end into ends[]; 1 where the stages hold every layer under the limit. */
static int fill(const Stage *stages, Py_ssize_t S, const double *outputs, Py_ssize_t L, double limit,
                Py_ssize_t *ends) {
    Py_ssize_t start = 0;
    for (Py_ssize_t j = 0; j < S; j++) {
        const Stage *s = &stages[j];
        Py_ssize_t end = bisect_right(s->acc, L + 1, s->acc[start] + limit) - 1;
        Py_ssize_t by_memory = bisect_right(s->mem, L + 1, s->mem[start] + s->capacity) - 1;
        if (by_memory < end) end = by_memory;
        if (s->last < end) end = s->last;
        if (end <= start || outputs[end - 1] * s->link > limit) return 0;
        ends[j] = end;
        start = end;
    }
    return start == L;
}

/* bottleneck_bisect(stages, outputs, lo, hi, bisections) -> [(start, end)] per stage, or None.
 * stages: [(time prefix, memory prefix, capacity, last end allowed, outgoing seconds per byte)];
 * outputs: each layer's output bytes. */
static PyObject *bottleneck_bisect(PyObject *self, PyObject *args) {
    PyObject *stage_list, *output_list;
    double lo, hi;
    int bisections;
    if (!PyArg_ParseTuple(args, "O!O!ddi", &PyList_Type, &stage_list, &PyList_Type, &output_list, &lo, &hi,
                          &bisections))
        return NULL;
    Py_ssize_t S = PyList_GET_SIZE(stage_list), L = PyList_GET_SIZE(output_list);
    if (S == 0) {
        PyErr_SetString(PyExc_TypeError, "a chain has at least one stage");
        return NULL;
    }
    /* the sizes below cannot overflow: a list holds fewer than PY_SSIZE_T_MAX / sizeof(void *) items, but
     * S stages may share one prefix list, so the product is checked */
    Py_ssize_t most = PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(double) / 4;
    if (L + 1 > most || S > most / (L + 1)) {
        PyErr_SetString(PyExc_MemoryError, "a chain too long to cut");
        return NULL;
    }
    double *numbers = PyMem_Malloc(sizeof(double) * (L + 2 * S * (L + 1)));
    Stage *stages = PyMem_Malloc(sizeof(Stage) * S);
    Py_ssize_t *ends = PyMem_Malloc(sizeof(Py_ssize_t) * 2 * S), *best = ends + S;
    PyObject *result = NULL;
    if (!numbers || !stages || !ends) {
        PyErr_NoMemory();
        goto done;
    }
    double *outputs = numbers;
    for (Py_ssize_t i = 0; i < L; i++)
        if (as_double(PyList_GET_ITEM(output_list, i), &outputs[i], NUMBERS) < 0) goto done;
    for (Py_ssize_t j = 0; j < S; j++) {
        PyObject *t = PyList_GET_ITEM(stage_list, j);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 5) {
            PyErr_SetString(PyExc_TypeError, "a stage is (time prefix, memory prefix, capacity, last end, link)");
            goto done;
        }
        Stage *s = &stages[j];
        s->acc = numbers + L + 2 * j * (L + 1);
        s->mem = s->acc + L + 1;
        if (read_prefix(PyTuple_GET_ITEM(t, 0), L, s->acc) < 0 || read_prefix(PyTuple_GET_ITEM(t, 1), L, s->mem) < 0 ||
            as_double(PyTuple_GET_ITEM(t, 2), &s->capacity, NUMBERS) < 0 ||
            as_double(PyTuple_GET_ITEM(t, 4), &s->link, NUMBERS) < 0)
            goto done;
        s->last = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 3));
        if (s->last == -1 && PyErr_Occurred()) goto done;
        if (s->last > L) s->last = L; /* an end is an index of the prefixes, whatever was passed */
    }
    if (!fill(stages, S, outputs, L, hi, best)) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    for (int k = 0; k < bisections; k++) {
        double mid = (lo + hi) / 2;
        if (fill(stages, S, outputs, L, mid, ends)) {
            hi = mid;
            memcpy(best, ends, sizeof(Py_ssize_t) * S);
        } else {
            lo = mid;
        }
    }
    result = PyList_New(S);
    if (!result) goto done;
    for (Py_ssize_t j = 0; j < S; j++) {
        PyObject *cut = Py_BuildValue("(nn)", j ? best[j - 1] : (Py_ssize_t)0, best[j]);
        if (!cut) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, j, cut);
    }
done:
    PyMem_Free(numbers);
    PyMem_Free(stages);
    PyMem_Free(ends);
    return result;
}

static PyMethodDef methods[] = {
    {"bottleneck_bisect", bottleneck_bisect, METH_VARARGS,
     "bottleneck_bisect(stages, outputs, lo, hi, bisections) -> the cuts of the least bottleneck found, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_bottleneck",
                                    "launcher/planning/bottleneck_fill.py's loop, compiled (same arithmetic).", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__bottleneck(void) { return PyModule_Create(&module); }
