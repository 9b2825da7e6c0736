/* The cut dynamic program's inner loop under 1F1B, compiled: launcher/planning/cut_front.py's
 * one_bottleneck_front_python, the same arithmetic in the same order on the same doubles and the
 * same tie-breaking (a stable sort by (max term, round-trip sum), then the points whose sum drops),
 * so the fronts agree to the bit for finite numbers (a profile holds no other: profile_file.py);
 * tests/planning/test_cut_front.py compares them. A 6-node plan
 * spends a third to a half of its time in this loop. Built as an optional extension (setup.py):
 * where it cannot be built, cut_front.py keeps its Python loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>

#include "_py_numbers.h"

typedef struct {
    double compute, link, window, total, key;
    Py_ssize_t end, next, order;
    PyObject *codec; /* borrowed from the crossing rows, which outlive the call */
} Point;

static int by_key_then_total(const void *a, const void *b) {
    const Point *x = a, *y = b;
    if (x->key < y->key) return -1;
    if (x->key > y->key) return 1;
    if (x->total < y->total) return -1;
    if (x->total > y->total) return 1;
    return (x->order > y->order) - (x->order < y->order); /* Python's sort is stable */
}

/* Python's max(a, b): a unless b is greater. */
static inline double pmax(double a, double b) { return b > a ? b : a; }

/* The tuple's i-th number (see _py_numbers.h). */
static int read_float(PyObject *tuple, Py_ssize_t i, double *out) {
    return as_double(PyTuple_GET_ITEM(tuple, i), out, "a cut front's");
}

/* one_bottleneck_front(rows, crossings) -> the front, as a list of
 * (compute max, link max, window max, total, end, next point, codec) tuples.
 * rows: [(end, stage compute, following front, window)], window what the row's window term divides
 * by (0: none); crossings: per codec, a list indexed by end of (link, latency, codec work, codec). */
static PyObject *one_bottleneck_front(PyObject *self, PyObject *args) {
    PyObject *rows, *crossings;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &rows, &PyList_Type, &crossings)) return NULL;
    Py_ssize_t num_rows = PyList_GET_SIZE(rows), num_codecs = PyList_GET_SIZE(crossings), count = 0;
    for (Py_ssize_t r = 0; r < num_rows; r++) {
        PyObject *row = PyList_GET_ITEM(rows, r);
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 4 || !PyList_Check(PyTuple_GET_ITEM(row, 2))) {
            PyErr_SetString(PyExc_TypeError, "a row is (end, compute, following front list, window)");
            return NULL;
        }
        count += PyList_GET_SIZE(PyTuple_GET_ITEM(row, 2)) * num_codecs;
    }
    PyObject *front = PyList_New(0);
    if (!front || count == 0) return front;
    Point *points = PyMem_Malloc(sizeof(Point) * count);
    if (!points) {
        Py_DECREF(front);
        return PyErr_NoMemory();
    }
    Py_ssize_t n = 0;
    for (Py_ssize_t r = 0; r < num_rows; r++) {
        PyObject *row = PyList_GET_ITEM(rows, r), *following = PyTuple_GET_ITEM(row, 2);
        Py_ssize_t end = PyLong_AsSsize_t(PyTuple_GET_ITEM(row, 0));
        double t, window;
        if ((end == -1 && PyErr_Occurred()) || read_float(row, 1, &t) < 0 || read_float(row, 3, &window) < 0) goto fail;
        for (Py_ssize_t c = 0; c < num_codecs; c++) {
            PyObject *per_end = PyList_GET_ITEM(crossings, c), *crossing;
            if (!PyList_Check(per_end) || end < 0 || end >= PyList_GET_SIZE(per_end) ||
                !PyTuple_Check(crossing = PyList_GET_ITEM(per_end, end)) || PyTuple_GET_SIZE(crossing) != 4) {
                PyErr_SetString(PyExc_TypeError, "a crossing is a list indexed by end of (link, latency, work, codec)");
                goto fail;
            }
            double link, latency, work;
            if (read_float(crossing, 0, &link) < 0 || read_float(crossing, 1, &latency) < 0 ||
                read_float(crossing, 2, &work) < 0)
                goto fail;
            PyObject *codec = PyTuple_GET_ITEM(crossing, 3);
            double tc = t + work;
            for (Py_ssize_t k = 0; k < PyList_GET_SIZE(following); k++) {
                PyObject *p = PyList_GET_ITEM(following, k);
                double mt, mc, w, s;
                if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) < 4) {
                    PyErr_SetString(PyExc_TypeError, "a front point is a tuple of at least 4 numbers");
                    goto fail;
                }
                if (read_float(p, 0, &mt) < 0 || read_float(p, 1, &mc) < 0 || read_float(p, 2, &w) < 0 ||
                    read_float(p, 3, &s) < 0)
                    goto fail;
                if (n >= count) { /* cannot happen: nothing above runs Python code; kept as a guard */
                    PyErr_SetString(PyExc_RuntimeError, "a front changed while it was read");
                    goto fail;
                }
                Point *q = &points[n];
                q->total = s + tc + 2 * (latency + link);
                q->compute = pmax(mt, tc);
                q->link = pmax(mc, link);
                q->window = window != 0.0 ? pmax(w, q->total / window) : w;
                q->key = pmax(pmax(q->compute, q->link), q->window);
                q->end = end;
                q->next = k;
                q->order = n;
                q->codec = codec;
                n++;
            }
        }
    }
    qsort(points, n, sizeof(Point), by_key_then_total);
    double best_sum = Py_HUGE_VAL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Point *q = &points[i];
        if (!(q->total < best_sum)) continue;
        best_sum = q->total;
        PyObject *kept = Py_BuildValue("(ddddnnO)", q->compute, q->link, q->window, q->total, q->end, q->next, q->codec);
        if (!kept || PyList_Append(front, kept) < 0) {
            Py_XDECREF(kept);
            goto fail;
        }
        Py_DECREF(kept);
    }
    PyMem_Free(points);
    return front;
fail:
    PyMem_Free(points);
    Py_DECREF(front);
    return NULL;
}

static PyMethodDef methods[] = {
    {"one_bottleneck_front", one_bottleneck_front, METH_VARARGS,
     "one_bottleneck_front(rows, crossings) -> the Pareto front of a cut state under 1F1B"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cutfront",
                                    "launcher/planning/cut_front.py's loop, compiled (same arithmetic).", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cutfront(void) { return PyModule_Create(&module); }
