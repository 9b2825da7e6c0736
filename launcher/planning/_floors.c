/* The dynamic program that decides whether any cut of a chain keeps every stage's floor term under
 * a bound, compiled: launcher/planning/chain_bounds.py's floors_program_python, with the same
 * answers: per stage the same furthest end of each start (searched here from the last start's),
 * the same choice between the sweep and every pair, the same start picked at each end (here by a
 * queue where that is the heap's pick, ties to the earlier start), priced with the same arithmetic
 * in the same order on the same doubles. tests/planning/test_compiled_cut_loops.py and
 * test_deep_models.py compare them. Built as an optional extension (setup.py): where it cannot be
 * built, chain_bounds.py keeps its Python loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

#include "_py_numbers.h"

#define NUMBERS "a floor's" /* as TypeErrors name them */
#define FLOOR_SLACK 1e-9 /* chain_bounds.SLACK (the module's SLACK; a test compares them) */
#define KEY_ERROR (16 * 0x1p-53) /* chain_bounds.KEY_ERROR */

/* A list of exactly n numbers into out[0..n-1]. */
static int read_list(PyObject *list, Py_ssize_t n, double *out) {
    if (!PyList_Check(list) || PyList_GET_SIZE(list) != n) {
        PyErr_SetString(PyExc_TypeError, "a floor's lists have one number per layer boundary, stage or hop");
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (as_double(PyList_GET_ITEM(list, i), &out[i], NUMBERS) < 0) return -1;
    return 0;
}

/* A start in the sweep's heap, by key (A - c acc[start]) then by start: Python's heapq of tuples. */
typedef struct {
    double key;
    Py_ssize_t start;
} Entry;

static inline int entry_less(const Entry *x, const Entry *y) {
    return x->key < y->key || (x->key == y->key && x->start < y->start);
}

static void heap_push(Entry *heap, Py_ssize_t *count, double key, Py_ssize_t start) {
    Py_ssize_t i = (*count)++;
    Entry item = {key, start};
    while (i > 0) {
        Py_ssize_t parent = (i - 1) / 2;
        if (!entry_less(&item, &heap[parent])) break;
        heap[i] = heap[parent];
        i = parent;
    }
    heap[i] = item;
}

static void heap_pop(Entry *heap, Py_ssize_t *count) {
    Entry item = heap[--(*count)];
    Py_ssize_t i = 0, n = *count;
    while (1) {
        Py_ssize_t child = 2 * i + 1;
        if (child >= n) break;
        if (child + 1 < n && entry_less(&heap[child + 1], &heap[child])) child++;
        if (!entry_less(&heap[child], &item)) break;
        heap[i] = heap[child];
        i = child;
    }
    if (n > 0) heap[i] = item;
}

/* A start's A carried to `end`: A + work / 3 + g work + hop, the Python loop's arithmetic and order. */
static inline double carried(double a, const double *acc, Py_ssize_t start, Py_ssize_t end, double g, double hop) {
    double work = acc[end] - acc[start];
    return a + work / 3 + g * work + hop;
}

/* One stage's sweep over its ends with every start reached in a heap (chain_bounds.py's): the least
 * key among the starts that reach each end, its A priced as the program prices it. */
static void heap_sweep(const double *states, const Py_ssize_t *reach, const double *acc, double per_work, double g,
                       double hop, Py_ssize_t last, Entry *heap, double *grown, int *reached) {
    Py_ssize_t count = 0, at = 0;
    for (Py_ssize_t end = 1; end <= last; end++) {
        for (; at < end; at++) /* the starts before this end join the heap */
            if (states[at] != Py_HUGE_VAL && reach[at] > at)
                heap_push(heap, &count, states[at] - per_work * acc[at], at);
        while (count > 0 && reach[heap[0].start] < end) heap_pop(heap, &count); /* ends only grow */
        if (count > 0) {
            grown[end] = carried(states[heap[0].start], acc, heap[0].start, end, g, hop);
            *reached = 1;
        }
    }
}

/* floors_under(layers, memory, capacities, optimizer, hops, M, limit, g, h) -> bool.
 * layers, memory: per stage, prefix sums over the layers (L + 1 each); capacities: per stage;
 * optimizer: the first stage's optimizer prefix sums (L + 1); hops: per boundary (S - 1). */
static PyObject *floors_under(PyObject *self, PyObject *args) {
    PyObject *layer_lists, *memory_lists, *capacity_list, *optimizer_list, *hop_list;
    double M, limit, g, h;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!dddd", &PyList_Type, &layer_lists, &PyList_Type, &memory_lists,
                          &PyList_Type, &capacity_list, &PyList_Type, &optimizer_list, &PyList_Type, &hop_list, &M,
                          &limit, &g, &h))
        return NULL;
    Py_ssize_t S = PyList_GET_SIZE(layer_lists), L = PyList_GET_SIZE(optimizer_list) - 1;
    if (S < 1 || L < 1 || PyList_GET_SIZE(memory_lists) != S) {
        PyErr_SetString(PyExc_TypeError, "a floor needs at least one stage and one layer, with memory per stage");
        return NULL;
    }
    /* the sizes below cannot overflow: S stages may share one prefix list, so the product is checked */
    Py_ssize_t most = PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(double) / 8;
    if (L + 1 > most || S > most / (L + 1)) {
        PyErr_SetString(PyExc_MemoryError, "a chain too long to bound");
        return NULL;
    }
    /* layers, memory: S x (L + 1); optimizer: L + 1; capacities: S; hops: S - 1; two rows of states */
    Py_ssize_t size = 2 * S * (L + 1) + (L + 1) + S + (S - 1) + 2 * (L + 1);
    double *numbers = PyMem_Malloc(sizeof(double) * size);
    if (!numbers) return PyErr_NoMemory();
    double *layers = numbers, *memory = layers + S * (L + 1), *optimizer = memory + S * (L + 1);
    double *capacities = optimizer + L + 1, *hops = capacities + S, *states = hops + S - 1, *grown = states + L + 1;
    PyObject *result = NULL;
    Py_ssize_t *reach = PyMem_Malloc(sizeof(Py_ssize_t) * (L + 1)); /* per start, its furthest end */
    Entry *heap = PyMem_Malloc(sizeof(Entry) * (L + 1));
    if (!reach || !heap) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < S; j++)
        if (read_list(PyList_GET_ITEM(layer_lists, j), L + 1, layers + j * (L + 1)) < 0 ||
            read_list(PyList_GET_ITEM(memory_lists, j), L + 1, memory + j * (L + 1)) < 0)
            goto done;
    if (read_list(optimizer_list, L + 1, optimizer) < 0 || read_list(capacity_list, S, capacities) < 0 ||
        read_list(hop_list, S - 1, hops) < 0)
        goto done;
    /* states[end]: the least A over the cuts whose stages so far end there; +inf where none does */
    for (Py_ssize_t i = 0; i <= L; i++) states[i] = Py_HUGE_VAL;
    states[0] = 0.0;
    double per_work = 1.0 / 3 + g;
    int reached = 1;
    for (Py_ssize_t j = 0; j < S && reached; j++) {
        /* A model of 100,000 layers spends a while per stage here: Ctrl-C took 12.7 s (a review). */
        if (PyErr_CheckSignals() < 0) goto done;
        const double *acc = layers + j * (L + 1), *mem = memory + j * (L + 1);
        Py_ssize_t last = j == S - 1 ? L : L - (S - 1 - j);
        if (last < 1) { /* more stages than layers: no end leaves every later stage one */
            reached = 0;
            break;
        }
        double hop = j < S - 1 ? (1 + h) * hops[j] : 0.0;
        for (Py_ssize_t i = 0; i <= L; i++) grown[i] = Py_HUGE_VAL;
        reached = 0;
        /* each start's furthest end: term and memory only grow with it (chain_bounds._furthest_end);
         * searched from the previous start's, near which it mostly lies, by strides that double */
        Py_ssize_t hint = 0;
        for (Py_ssize_t start = 0; start <= L; start++) {
            double a = states[start];
            if (a == Py_HUGE_VAL) continue;
            const double *opt = j == 0 ? optimizer : NULL;
            double cap = capacities[j];
            Py_ssize_t good = start, bad = last + 1; /* good fits (or is start: none yet), bad does not (or is past) */
#define FITS(e) (!(a + M * (acc[e] - acc[start]) + (opt ? opt[e] - opt[start] : 0.0) > limit || \
                   mem[e] - mem[start] > cap))
            if (hint > start && hint <= last) {
                Py_ssize_t stride = 1;
                if (FITS(hint)) {
                    good = hint;
                    while (good + stride < bad) {
                        if (!FITS(good + stride)) {
                            bad = good + stride;
                            break;
                        }
                        good += stride;
                        stride *= 2;
                    }
                } else {
                    bad = hint;
                    while (bad - stride > good) {
                        if (FITS(bad - stride)) {
                            good = bad - stride;
                            break;
                        }
                        bad -= stride;
                        stride *= 2;
                    }
                }
            }
            while (bad - good > 1) {
                Py_ssize_t mid = good + (bad - good) / 2;
                if (FITS(mid))
                    good = mid;
                else
                    bad = mid;
            }
#undef FITS
            reach[start] = hint = good;
        }
        /* the sweep only where its pick by key is priced within KEY_ERROR of the least (chain_bounds.py) */
        double most_a = 0.0;
        for (Py_ssize_t start = 0; start <= L; start++)
            if (states[start] != Py_HUGE_VAL && fabs(states[start]) > most_a) most_a = fabs(states[start]);
        double key_error = KEY_ERROR * (most_a + 2 * per_work * acc[last] + fabs(hop));
        if (j == S - 1 || !(key_error <= limit * FLOOR_SLACK / (4 * (double)S))) {
            /* every pair (the last stage has one end, L: each start that reaches it, priced directly) */
            for (Py_ssize_t start = 0; start <= L; start++) {
                double a = states[start];
                if (a == Py_HUGE_VAL) continue;
                for (Py_ssize_t end = j == S - 1 ? L : start + 1; end <= reach[start]; end++) {
                    double next = carried(a, acc, start, end, g, hop);
                    if (next < grown[end]) {
                        grown[end] = next;
                        reached = 1;
                    }
                }
            }
        } else {
            /* A queue of increasing keys holds the least in front: a start whose key is above a
             * later one's is dropped when that one joins, being never the least again while the later
             * one reaches at least as far, which holds in exact arithmetic where M >= 1/3 + g (a
             * start's A grows with it by at most that much more per unit of work than its reach
             * allows). Where rounding or M says otherwise for a start dropped, the stage is swept
             * again with the heap, which keeps every start. On equal keys the earlier stays in front,
             * as in the heap, so both pick the same start. */
            Py_ssize_t head = 0, tail = 0, at = 0;
            int dropped_further = 0;
            for (Py_ssize_t end = 1; end <= last && !dropped_further; end++) {
                for (; at < end; at++)
                    if (states[at] != Py_HUGE_VAL && reach[at] > at) {
                        double key = states[at] - per_work * acc[at];
                        while (tail > head && heap[tail - 1].key > key) {
                            if (reach[heap[tail - 1].start] > reach[at]) dropped_further = 1;
                            tail--;
                        }
                        heap[tail].key = key;
                        heap[tail++].start = at;
                    }
                while (tail > head && reach[heap[head].start] < end) head++; /* ends only grow */
                if (tail > head) {
                    grown[end] = carried(states[heap[head].start], acc, heap[head].start, end, g, hop);
                    reached = 1;
                }
            }
            if (dropped_further) {
                for (Py_ssize_t i = 0; i <= L; i++) grown[i] = Py_HUGE_VAL;
                reached = 0;
                heap_sweep(states, reach, acc, per_work, g, hop, last, heap, grown, &reached);
            }
        }
        double *swap = states;
        states = grown;
        grown = swap;
    }
    result = PyBool_FromLong(reached && states[L] != Py_HUGE_VAL);
done:
    PyMem_Free(numbers);
    PyMem_Free(reach);
    PyMem_Free(heap);
    return result;
}

static PyMethodDef methods[] = {
    {"floors_under", floors_under, METH_VARARGS,
     "floors_under(layers, memory, capacities, optimizer, hops, M, limit, g, h) -> whether some cut's floors stay "
     "under the limit"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_floors",
                                    "launcher/planning/chain_bounds.py's floor program, compiled (same arithmetic).",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__floors(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddObject(m, "SLACK", PyFloat_FromDouble(FLOOR_SLACK)) < 0 ||
              PyModule_AddObject(m, "KEY_ERROR", PyFloat_FromDouble(KEY_ERROR)) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
