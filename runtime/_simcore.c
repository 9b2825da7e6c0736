/* The planner's two hottest loops, compiled: runtime/fast_simulation.py's simulate_in_order and
 * simulate_stages, the same arithmetic in the same order on the same doubles (additions and
 * comparisons only, so the steps agree to the bit; tests/stage/test_simulation_core.py compares
 * them). The planner prices tens of thousands of candidate pipelines by these, and the Python loops
 * were most of its time (a 6-node plan: 16 of 24 CPU-s in them). Built as an optional extension
 * (setup.py): where it cannot be built, fast_simulation.py keeps its Python loops.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* A sequence of numbers as doubles (at least `need` of them); 0 on success, -1 with an error set. */
static int read_doubles(PyObject *seq, Py_ssize_t need, double **out, Py_ssize_t *len) {
    /* A tuple (the same object where it is one): an item's __float__ cannot change what is read. */
    PyObject *fast = PySequence_Tuple(seq);
    if (!fast) return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(fast);
    if (n < need) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "%zd costs given where %zd are needed", n, need);
        return -1;
    }
    double *values = PyMem_Malloc(sizeof(double) * (n ? n : 1));
    if (!values) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        values[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(fast, i));
        if (values[i] == -1.0 && PyErr_Occurred()) {
            PyMem_Free(values);
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    *out = values;
    if (len) *len = n;
    return 0;
}

typedef struct {
    double *forward, *backward, *link, *latency, *optimizer;
    Py_ssize_t num_optimizer;
} Costs;

static void free_costs(Costs *c) {
    PyMem_Free(c->forward);
    PyMem_Free(c->backward);
    PyMem_Free(c->link);
    PyMem_Free(c->latency);
    PyMem_Free(c->optimizer);
}

/* S stages' costs: forward and backward S, link and latency S - 1, optimizer (zip's length, as in Python). */
static int read_costs(PyObject *f, PyObject *b, PyObject *l, PyObject *lat, PyObject *o, Py_ssize_t *S, Costs *c) {
    memset(c, 0, sizeof(*c));
    Py_ssize_t n;
    if (read_doubles(f, 0, &c->forward, &n) < 0) return -1;
    *S = n;
    if (read_doubles(b, n, &c->backward, NULL) < 0 || read_doubles(l, n ? n - 1 : 0, &c->link, NULL) < 0 ||
        read_doubles(lat, n ? n - 1 : 0, &c->latency, NULL) < 0 ||
        read_doubles(o, 0, &c->optimizer, &c->num_optimizer) < 0) {
        free_costs(c);
        return -1;
    }
    return 0;
}

/* max(t + o for t, o in zip(free_at, optimizer)), as Python's max: the first of equals. */
static PyObject *step_of(const double *free_at, Py_ssize_t S, const Costs *c) {
    Py_ssize_t n = S < c->num_optimizer ? S : c->num_optimizer;
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "max() arg is an empty sequence");
        return NULL;
    }
    double best = free_at[0] + c->optimizer[0];
    for (Py_ssize_t d = 1; d < n; d++) {
        double v = free_at[d] + c->optimizer[d];
        if (v > best) best = v;
    }
    return PyFloat_FromDouble(best);
}

static PyObject *simulate_in_order(PyObject *self, PyObject *args) {
    PyObject *order, *f, *b, *l, *lat, *o;
    Py_ssize_t M;
    if (!PyArg_ParseTuple(args, "OnOOOOO", &order, &M, &f, &b, &l, &lat, &o)) return NULL;
    Py_ssize_t S;
    Costs c;
    if (read_costs(f, b, l, lat, o, &S, &c) < 0) return NULL;
    PyObject *fast = PySequence_Tuple(order);
    if (!fast) {
        free_costs(&c);
        return NULL;
    }
    if (M > 0 && S > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(double) / M) {
        Py_DECREF(fast);
        free_costs(&c);
        return PyErr_NoMemory();
    }
    Py_ssize_t cells = S * (M > 0 ? M : 1);
    double *f_done = PyMem_Calloc(cells, sizeof(double)), *f_in = PyMem_Calloc(cells, sizeof(double));
    double *b_in = PyMem_Calloc(cells, sizeof(double)), *wires = PyMem_Calloc(3 * (S ? S : 1), sizeof(double));
    PyObject *result = NULL;
    if (!f_done || !f_in || !b_in || !wires) {
        PyErr_NoMemory();
        goto done;
    }
    double *down_free = wires, *up_free = wires + S, *free_at = wires + 2 * S;
    Py_ssize_t last = S - 1, n = PyTuple_GET_SIZE(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyTuple_GET_ITEM(fast, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "order must hold (stage, action) pairs");
            goto done;
        }
        Py_ssize_t d = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 0));
        if (d == -1 && PyErr_Occurred()) goto done;
        Py_ssize_t m = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 1));
        if (m == -1 && PyErr_Occurred()) goto done;
        Py_ssize_t mb = m >= 0 ? m : ~m;
        if (d < 0 || d >= S || mb >= M) {
            PyErr_SetString(PyExc_IndexError, "order names a stage or micro-batch out of range");
            goto done;
        }
        double t = free_at[d];
        if (m >= 0) {
            if (d) {
                double ready = f_in[d * M + m];
                if (ready > t) t = ready;
            }
            t += c.forward[d];
            f_done[d * M + m] = t;
            if (d < last) {
                double down = down_free[d];
                down = (t > down ? t : down) + c.link[d];
                down_free[d] = down;
                f_in[(d + 1) * M + m] = down + c.latency[d];
            }
        } else {
            double ready = f_done[d * M + mb];
            if (d < last) {
                double grad = b_in[d * M + mb];
                if (grad > ready) ready = grad;
            }
            t = (ready > t ? ready : t) + c.backward[d];
            if (d) {
                double up = up_free[d];
                up = (t > up ? t : up) + c.link[d - 1];
                up_free[d] = up;
                b_in[(d - 1) * M + mb] = up + c.latency[d - 1];
            }
        }
        free_at[d] = t;
    }
    result = step_of(free_at, S, &c);
done:
    PyMem_Free(f_done);
    PyMem_Free(f_in);
    PyMem_Free(b_in);
    PyMem_Free(wires);
    Py_DECREF(fast);
    free_costs(&c);
    return result;
}

static PyObject *simulate_stages(PyObject *self, PyObject *args) {
    PyObject *plan, *f, *b, *l, *lat, *o, *order = Py_None;
    if (!PyArg_ParseTuple(args, "OOOOOO|O", &plan, &f, &b, &l, &lat, &o, &order)) return NULL;
    if (order != Py_None && !PyList_Check(order)) {
        PyErr_SetString(PyExc_TypeError, "order must be a list or None");
        return NULL;
    }
    PyObject *stages = PySequence_Tuple(plan);
    if (!stages) return NULL;
    Py_ssize_t S = PyTuple_GET_SIZE(stages);
    Py_ssize_t S_costs;
    Costs c;
    if (read_costs(f, b, l, lat, o, &S_costs, &c) < 0) {
        Py_DECREF(stages);
        return NULL;
    }
    PyObject *result = NULL, *stage_tuples = NULL;
    Py_ssize_t *actions = NULL, *starts = NULL, *next_idx = NULL;
    double *times = NULL;
    unsigned char *known = NULL;
    if (S == 0) {
        PyErr_SetString(PyExc_IndexError, "tuple index out of range");
        goto done;
    }
    if (S_costs < S) {
        PyErr_SetString(PyExc_ValueError, "fewer costs than stages");
        goto done;
    }
    /* every stage's actions in one array; starts[d] .. starts[d + 1] */
    starts = PyMem_Calloc(S + 1, sizeof(Py_ssize_t));
    next_idx = PyMem_Calloc(S, sizeof(Py_ssize_t));
    if (!starts || !next_idx) {
        PyErr_NoMemory();
        goto done;
    }
    /* Each stage's list as a tuple (read once, so its length is what is read), then as integers. */
    stage_tuples = PyTuple_New(S);
    if (!stage_tuples) goto done;
    for (Py_ssize_t d = 0; d < S; d++) {
        PyObject *stage = PySequence_Tuple(PyTuple_GET_ITEM(stages, d));
        if (!stage) goto done;
        PyTuple_SET_ITEM(stage_tuples, d, stage);
        starts[d + 1] = starts[d] + PyTuple_GET_SIZE(stage);
    }
    Py_ssize_t total = starts[S];
    Py_ssize_t num_mb = PyTuple_GET_SIZE(PyTuple_GET_ITEM(stage_tuples, 0)) / 2;
    if (num_mb > 0 && S > PY_SSIZE_T_MAX / 3 / (Py_ssize_t)sizeof(double) / num_mb) {
        PyErr_NoMemory();
        goto done;
    }
    actions = PyMem_Malloc(sizeof(Py_ssize_t) * (total ? total : 1));
    Py_ssize_t cells = S * (num_mb ? num_mb : 1);
    times = PyMem_Calloc(3 * cells + 3 * S, sizeof(double));
    known = PyMem_Calloc(3 * cells, 1);
    if (!actions || !times || !known) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t d = 0; d < S; d++) {
        PyObject *stage = PyTuple_GET_ITEM(stage_tuples, d);
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(stage); i++) {
            Py_ssize_t m = PyLong_AsSsize_t(PyTuple_GET_ITEM(stage, i));
            if (m == -1 && PyErr_Occurred()) goto done;
            if ((m >= 0 ? m : ~m) >= num_mb) {
                PyErr_SetString(PyExc_IndexError, "list index out of range");
                goto done;
            }
            actions[starts[d] + i] = m;
        }
    }
    /* As in Python: f_done, f_in and b_in per stage and micro-batch, with `known` for "not None". */
    double *f_done = times, *f_in = times + cells, *b_in = times + 2 * cells;
    unsigned char *have_done = known, *have_in = known + cells, *have_grad = known + 2 * cells;
    double *down_free = times + 3 * cells, *up_free = down_free + S, *free_at = up_free + S;
    Py_ssize_t last = S - 1, remaining = total, sweep = 0;
    while (remaining) {
        int progressed = 0;
        sweep += 1;
        for (Py_ssize_t k = 0; k < S; k++) {
            Py_ssize_t d = sweep % 2 ? k : S - 1 - k; /* down the pipe, then up it: see fast_simulation.py */
            Py_ssize_t i = next_idx[d], n = starts[d + 1] - starts[d];
            if (i == n) continue;
            const Py_ssize_t *acts = actions + starts[d];
            double t = free_at[d], f_c = c.forward[d], b_c = c.backward[d];
            double down = 0.0, up = 0.0;
            if (d < last) down = down_free[d];
            if (d) up = up_free[d];
            Py_ssize_t start = i;
            while (i < n) {
                Py_ssize_t m = acts[i];
                if (m >= 0) {
                    if (d) {
                        if (!have_in[d * num_mb + m]) break;
                        double ready = f_in[d * num_mb + m];
                        if (ready > t) t = ready;
                    }
                    t += f_c;
                    f_done[d * num_mb + m] = t;
                    have_done[d * num_mb + m] = 1;
                    if (d < last) {
                        down = (t > down ? t : down) + c.link[d];
                        f_in[(d + 1) * num_mb + m] = down + c.latency[d];
                        have_in[(d + 1) * num_mb + m] = 1;
                    }
                } else {
                    m = ~m;
                    if (!have_done[d * num_mb + m]) break;
                    double ready = f_done[d * num_mb + m];
                    if (d < last) {
                        if (!have_grad[d * num_mb + m]) break;
                        double grad = b_in[d * num_mb + m];
                        if (grad > ready) ready = grad;
                    }
                    t = (ready > t ? ready : t) + b_c;
                    if (d) {
                        up = (t > up ? t : up) + c.link[d - 1];
                        b_in[(d - 1) * num_mb + m] = up + c.latency[d - 1];
                        have_grad[(d - 1) * num_mb + m] = 1;
                    }
                }
                i += 1;
            }
            if (i != start) {
                if (order != Py_None) {
                    for (Py_ssize_t j = start; j < i; j++) {
                        PyObject *pair = Py_BuildValue("(nn)", d, acts[j]);
                        if (!pair || PyList_Append(order, pair) < 0) {
                            Py_XDECREF(pair);
                            goto done;
                        }
                        Py_DECREF(pair);
                    }
                }
                free_at[d] = t;
                next_idx[d] = i;
                remaining -= i - start;
                progressed = 1;
                if (d < last) down_free[d] = down;
                if (d) up_free[d] = up;
            }
        }
        if (!progressed) {
            PyErr_SetString(PyExc_ValueError, "schedule deadlocks");
            goto done;
        }
    }
    result = step_of(free_at, S, &c);
done:
    PyMem_Free(actions);
    PyMem_Free(starts);
    PyMem_Free(next_idx);
    PyMem_Free(times);
    PyMem_Free(known);
    Py_XDECREF(stage_tuples);
    Py_DECREF(stages);
    free_costs(&c);
    return result;
}

static PyMethodDef methods[] = {
    {"simulate_in_order", simulate_in_order, METH_VARARGS,
     "simulate_in_order(order, num_microbatches, forward, backward, link, latency, optimizer) -> step seconds"},
    {"simulate_stages", simulate_stages, METH_VARARGS,
     "simulate_stages(plan, forward, backward, link, latency, optimizer, order=None) -> step seconds"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_simcore",
                                    "runtime/fast_simulation.py's loops, compiled (same arithmetic).", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__simcore(void) { return PyModule_Create(&module); }
