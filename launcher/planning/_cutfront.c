/* The cut dynamic program under 1F1B, compiled (launcher/planning/cut_front.py's loops, the same
 * arithmetic in the same order on the same doubles and the same tie-breaking: a stable sort by
 * (max term, round-trip sum), then the points whose sum drops), so the fronts agree to the bit for
 * finite numbers (a profile holds no other: profile_file.py); tests/planning/test_cut_front.py
 * compares them.
 *   one_bottleneck_front: one state's front from its rows (one_bottleneck_front_python);
 *   suffix_fronts: every state of one suffix of stages at the starts asked, the rows built here
 *   too (suffix_fronts_python): a Python loop per state's rows was half of planning ten one-node
 *   regions.
 *   three_term_fronts: the same where the closed form prices compute, link and round trip apart
 *   (GPipe, ZB-H1, ZB-H2; three_term_fronts_python): a three-term front, sorted, then kept with a
 *   staircase of the kept points' (link, sum) pairs.
 * Built as an optional extension (setup.py): where it cannot be built, cut_front.py keeps its
 * Python loops.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "_py_numbers.h"

typedef struct {
    double compute, link, window, total, key;
    Py_ssize_t end, next, order;
    PyObject *codec; /* borrowed: held by the call's list of codecs (one_bottleneck_front) or by the
                      * crossing read once (suffix_fronts) until the front is built */
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

/* Points in a buffer that grows. */
typedef struct {
    Point *items;
    Py_ssize_t n, cap;
} Points;

static int reserve(Points *points, Py_ssize_t more) {
    if (points->n + more <= points->cap) return 0;
    Py_ssize_t cap = points->cap ? points->cap : 64;
    while (cap < points->n + more) cap *= 2;
    Point *grown = PyMem_Realloc(points->items, sizeof(Point) * cap);
    if (!grown) {
        PyErr_NoMemory();
        return -1;
    }
    points->items = grown;
    points->cap = cap;
    return 0;
}

/* A state's front under way: `front` holds what is kept so far, sorted by (max term, sum, order
 * made) with sums falling; each row's points for one codec (a run) are merged into it. The front
 * of all the points (sorted, each kept where its sum is below every earlier one's) is the front
 * of the fronts of any split of them into parts: a point dropped within a part is dropped by the
 * same earlier point among all, and what it would have dropped that point drops too. So merging
 * run by run keeps what one sort of every point would, with a few dozen kept between runs where
 * one sort took the ~500 points a state has (a 10-region plan makes 44 million). */
typedef struct {
    Points front, run, merged;
} State;

static void state_free(State *state) {
    PyMem_Free(state->front.items);
    PyMem_Free(state->run.items);
    PyMem_Free(state->merged.items);
}

/* Whether x sorts before y by (max term, sum, order made). */
static inline int sorts_before(const Point *x, const Point *y) {
    if (x->key != y->key) return x->key < y->key;
    if (x->total != y->total) return x->total < y->total;
    return x->order < y->order;
}

/* Merges the run (sorted) into the front, keeping the points whose sum is below every earlier one's.
 * Most of a run falls behind the front (a state keeps ~18 of its ~650 points): a run point whose
 * sum is not below that of the front's last point sorting before it is dropped first, with no copy. */
static int merge_run(State *state) {
    Points *front = &state->front, *run = &state->run, *merged = &state->merged;
    Py_ssize_t a = 0, left = 0;
    for (Py_ssize_t b = 0; b < run->n; b++) {
        Point *q = &run->items[b];
        while (a < front->n && sorts_before(&front->items[a], q)) a++;
        if (a > 0 && !(q->total < front->items[a - 1].total)) continue;
        if (left != b) run->items[left] = *q;
        left++;
    }
    run->n = left;
    if (left == 0) return 0;
    merged->n = 0;
    if (reserve(merged, front->n + run->n) < 0) return -1;
    Py_ssize_t b = 0;
    double best_sum = Py_HUGE_VAL;
    a = 0;
    while (a < front->n || b < run->n) {
        Point *q;
        if (b >= run->n || (a < front->n && sorts_before(&front->items[a], &run->items[b])))
            q = &front->items[a++];
        else
            q = &run->items[b++];
        if (q->total < best_sum) {
            best_sum = q->total;
            merged->items[merged->n++] = *q;
        }
    }
    Points kept = *front; /* the merged points become the front; its buffer the next merge's */
    *front = *merged;
    *merged = kept;
    return 0;
}

/* A following front's first four numbers per point (compute max, link max, window max, sum), read
 * once: a state's rows read each following front once per codec, and every state of a suffix
 * reads the same ones. */
typedef struct {
    double *values; /* 4 per point; NULL until read */
    Py_ssize_t n;
    double least_sum; /* the least of the points' sums (the last one's, unless rounding tied two) */
} Numbers;

static int read_front(PyObject *following, Numbers *out) {
    Py_ssize_t n = PyList_GET_SIZE(following);
    double *values = PyMem_Malloc(sizeof(double) * 4 * (n ? n : 1));
    if (!values) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t k = 0; k < n; k++) { /* nothing here runs Python code: the list keeps its size */
        PyObject *p = PyList_GET_ITEM(following, k);
        if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) < 4) {
            PyErr_SetString(PyExc_TypeError, "a front point is a tuple of at least 4 numbers");
            PyMem_Free(values);
            return -1;
        }
        for (int i = 0; i < 4; i++)
            if (read_float(p, i, &values[4 * k + i]) < 0) {
                PyMem_Free(values);
                return -1;
            }
    }
    double least = Py_HUGE_VAL;
    for (Py_ssize_t k = 0; k < n; k++)
        if (values[4 * k + 3] < least) least = values[4 * k + 3];
    out->values = values;
    out->n = n;
    out->least_sum = least;
    return 0;
}

/* A crossing's numbers, read once: (link, latency, codec work) and its codec (borrowed). */
typedef struct {
    double link, latency, work;
    PyObject *codec; /* NULL until read */
} Crossing;

/* Whether the front already drops every point a row would add: each of them has a max term of at
 * least `least_key` (its stage's compute and link) and a sum of at least `least_sum` (the following
 * front's least sum, this stage and crossing added in the same order of operations). The front's
 * last point with a max term at or below least_key then sorts before each of them (by max term,
 * then sum, then the order made, in which it came first); where its sum is at or below least_sum,
 * merge_run drops each (the sums fall along the front), so the points need not be made at all.
 * Late ends of a slow stage: its compute raises both terms. */
static int row_is_dominated(const Points *front, double least_key, double least_sum) {
    Py_ssize_t lo = 0, hi = front->n; /* the first point whose max term is above least_key */
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (front->items[mid].key <= least_key)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo > 0 && front->items[lo - 1].total <= least_sum;
}

/* One row's points for one codec, each point of the following front with this stage before it,
 * merged into the state's front. Where their sums fall strictly from point to point (as a front's
 * do, unless rounding ties two), only the points whose max term is below every later one's can
 * be kept (a later point with a max term as low has a lower sum and sorts before), and those come
 * sorted; otherwise the run is sorted here. */
static int add_row_points(State *state, const Numbers *following, Py_ssize_t end, double t, double window,
                          const Crossing *crossing, Py_ssize_t *order) {
    double link = crossing->link, latency = crossing->latency, tc = t + crossing->work;
    Points *run = &state->run;
    run->n = 0;
    if (row_is_dominated(&state->front, pmax(tc, link), following->least_sum + tc + 2 * (latency + link))) {
        *order += following->n; /* as if made: the points' order numbers stay those of the full loop */
        return 0;
    }
    if (reserve(run, following->n) < 0) return -1;
    int falling = 1; /* each point's sum below the one before */
    double previous_sum = Py_HUGE_VAL;
    for (Py_ssize_t k = 0; k < following->n; k++) {
        const double *p = &following->values[4 * k];
        double mt = p[0], mc = p[1], w = p[2], s = p[3];
        Point *q = &run->items[run->n++];
        q->total = s + tc + 2 * (latency + link);
        if (!(q->total < previous_sum)) falling = 0;
        previous_sum = q->total;
        q->compute = pmax(mt, tc);
        q->link = pmax(mc, link);
        q->window = window != 0.0 ? pmax(w, q->total / window) : w;
        q->key = pmax(pmax(q->compute, q->link), q->window);
        q->end = end;
        q->next = k;
        q->order = (*order)++;
        q->codec = crossing->codec;
    }
    if (falling) { /* keep the points whose max term is below every later one's, in their order */
        double least_later = Py_HUGE_VAL;
        Py_ssize_t kept = run->n;
        for (Py_ssize_t k = run->n - 1; k >= 0; k--) {
            if (run->items[k].key < least_later) {
                least_later = run->items[k].key;
                run->items[--kept] = run->items[k];
            }
        }
        memmove(run->items, &run->items[kept], sizeof(Point) * (run->n - kept));
        run->n -= kept;
    } else {
        qsort(run->items, run->n, sizeof(Point), by_key_then_total);
    }
    return merge_run(state);
}

/* The state's front as a new list of (compute max, link max, window max, total, end, next, codec). */
static PyObject *take_front(State *state) {
    PyObject *front = PyList_New(state->front.n);
    if (!front) return NULL;
    for (Py_ssize_t i = 0; i < state->front.n; i++) {
        Point *q = &state->front.items[i];
        PyObject *kept = PyTuple_New(7);
        if (!kept) {
            Py_DECREF(front);
            return NULL;
        }
        PyList_SET_ITEM(front, i, kept);
        PyObject *items[7] = {PyFloat_FromDouble(q->compute), PyFloat_FromDouble(q->link),
                              PyFloat_FromDouble(q->window), PyFloat_FromDouble(q->total),
                              PyLong_FromSsize_t(q->end), PyLong_FromSsize_t(q->next), q->codec};
        Py_INCREF(q->codec);
        int failed = 0;
        for (int k = 0; k < 7; k++) {
            failed |= items[k] == NULL;
            PyTuple_SET_ITEM(kept, k, items[k]); /* a NULL item is left NULL: the tuple's dealloc skips it */
        }
        if (failed) {
            Py_DECREF(front);
            PyErr_NoMemory();
            return NULL;
        }
    }
    return front;
}

/* The crossing of codec list `per_end` at `end` into *out, checked: (link, latency, work, codec). */
static int read_crossing(PyObject *per_end, Py_ssize_t end, Crossing *out) {
    PyObject *crossing;
    if (!PyList_Check(per_end) || end < 0 || end >= PyList_GET_SIZE(per_end) ||
        !PyTuple_Check(crossing = PyList_GET_ITEM(per_end, end)) || PyTuple_GET_SIZE(crossing) != 4) {
        PyErr_SetString(PyExc_TypeError, "a crossing is a list indexed by end of (link, latency, work, codec)");
        return -1;
    }
    if (read_float(crossing, 0, &out->link) < 0 || read_float(crossing, 1, &out->latency) < 0 ||
        read_float(crossing, 2, &out->work) < 0)
        return -1;
    out->codec = PyTuple_GET_ITEM(crossing, 3);
    Py_INCREF(out->codec); /* held while points name it: the lists it came from could change between reads */
    return 0;
}

/* one_bottleneck_front(rows, crossings) -> the front, as a list of
 * (compute max, link max, window max, total, end, next point, codec) tuples.
 * rows: [(end, stage compute, following front, window)], window what the row's window term divides
 * by (0: none); crossings: per codec, a list indexed by end of (link, latency, codec work, codec). */
static PyObject *one_bottleneck_front(PyObject *self, PyObject *args) {
    PyObject *rows, *crossings;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &rows, &PyList_Type, &crossings)) return NULL;
    Py_ssize_t num_rows = PyList_GET_SIZE(rows), num_codecs = PyList_GET_SIZE(crossings), order = 0;
    for (Py_ssize_t r = 0; r < num_rows; r++) {
        PyObject *row = PyList_GET_ITEM(rows, r);
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 4 || !PyList_Check(PyTuple_GET_ITEM(row, 2))) {
            PyErr_SetString(PyExc_TypeError, "a row is (end, compute, following front list, window)");
            return NULL;
        }
    }
    State state = {{NULL, 0, 0}, {NULL, 0, 0}, {NULL, 0, 0}};
    Numbers numbers = {NULL, 0};
    PyObject *codecs = PyList_New(0);
    if (!codecs) return NULL;
    for (Py_ssize_t r = 0; r < num_rows; r++) {
        PyObject *row = PyList_GET_ITEM(rows, r), *following = PyTuple_GET_ITEM(row, 2);
        Py_ssize_t end = PyLong_AsSsize_t(PyTuple_GET_ITEM(row, 0));
        double t, window;
        if ((end == -1 && PyErr_Occurred()) || read_float(row, 1, &t) < 0 || read_float(row, 3, &window) < 0) goto fail;
        PyMem_Free(numbers.values);
        numbers.values = NULL;
        if (read_front(following, &numbers) < 0) goto fail;
        for (Py_ssize_t c = 0; c < num_codecs; c++) {
            Crossing crossing;
            if (read_crossing(PyList_GET_ITEM(crossings, c), end, &crossing) < 0) goto fail;
            /* held until the front is built: take_front allocates, which can run the cyclic GC, whose
             * finalizers could replace the crossings' tuples and free a codec the points name */
            int held = PyList_Append(codecs, crossing.codec);
            Py_DECREF(crossing.codec);
            if (held < 0 || add_row_points(&state, &numbers, end, t, window, &crossing, &order) < 0) goto fail;
        }
    }
    PyObject *front = take_front(&state);
    state_free(&state);
    PyMem_Free(numbers.values);
    Py_DECREF(codecs);
    return front;
fail:
    state_free(&state);
    PyMem_Free(numbers.values);
    Py_DECREF(codecs);
    return NULL;
}

/* Python's a // b for floats (floatobject.c's float_floor_div), so a window agrees to the last micro-batch. */
static double floor_divide(double vx, double wx) {
    double mod = fmod(vx, wx), div = (vx - mod) / wx;
    if (mod && ((wx < 0) != (mod < 0))) div -= 1.0;
    if (!div) return copysign(0.0, vx / wx);
    double floordiv = floor(div);
    if (div - floordiv > 0.5) floordiv += 1.0;
    return floordiv;
}

/* Reads a list of L + 1 numbers into a new C array; NULL with an error set otherwise. */
static double *read_prefix(PyObject *list, Py_ssize_t size, const char *what) {
    if (!PyList_Check(list) || PyList_GET_SIZE(list) != size) {
        PyErr_Format(PyExc_TypeError, "%s is a list of %zd numbers", what, size);
        return NULL;
    }
    double *out = PyMem_Malloc(sizeof(double) * (size ? size : 1));
    if (!out) return (double *)PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < size; i++)
        if (as_double(PyList_GET_ITEM(list, i), &out[i], what) < 0) {
            PyMem_Free(out);
            return NULL;
        }
    return out;
}

/* Appends the state's front (take_front) to `out`; -1 with an error set. */
static int append_front(State *state, PyObject *out) {
    PyObject *front = take_front(state);
    int failed = !front || PyList_Append(out, front) < 0;
    Py_XDECREF(front);
    return failed ? -1 : 0;
}

/* A suffix of stages as suffix_fronts and three_term_fronts read it: the starts asked, the stage's
 * prefix sums and memory, and the following fronts and crossings, each read on first use. */
typedef struct {
    PyObject *starts, *crossings, *following; /* borrowed: the call's arguments */
    double memory;
    Py_ssize_t own, M, last_end, size, num_codecs;
    double *acc, *fixed, *activation;
    Numbers *fronts;    /* per end */
    Crossing *crossing; /* per end and codec */
} Suffix;

static void suffix_free(Suffix *x) {
    for (Py_ssize_t end = 0; x->fronts && end < x->size; end++) PyMem_Free(x->fronts[end].values);
    for (Py_ssize_t k = 0; x->crossing && k < x->size * x->num_codecs; k++) Py_XDECREF(x->crossing[k].codec);
    PyMem_Free(x->fronts);
    PyMem_Free(x->crossing);
    PyMem_Free(x->acc);
    PyMem_Free(x->fixed);
    PyMem_Free(x->activation);
}

/* Checks what was parsed into x and reads the prefix sums; -1 with an error set (then suffix_free). */
static int suffix_read(Suffix *x, PyObject *time_list, PyObject *static_list, PyObject *activation_list) {
    x->size = PyList_GET_SIZE(x->following);
    x->num_codecs = PyList_GET_SIZE(x->crossings);
    if (x->own < 1 || x->M < 1) {
        PyErr_SetString(PyExc_ValueError, "the in-flight count and the micro-batches are at least 1");
        return -1;
    }
    if (x->last_end < 0 || x->last_end >= x->size) {
        PyErr_SetString(PyExc_ValueError, "the last end is past the following fronts");
        return -1;
    }
    x->fronts = PyMem_Calloc(x->size, sizeof(Numbers)); /* per end, read on first use */
    x->crossing = PyMem_Calloc(x->size * (x->num_codecs ? x->num_codecs : 1), sizeof(Crossing));
    if (!x->fronts || !x->crossing) {
        PyErr_NoMemory();
        return -1;
    }
    if (!(x->acc = read_prefix(time_list, x->size, "a time prefix")) ||
        !(x->fixed = read_prefix(static_list, x->size, "a static prefix")) ||
        !(x->activation = read_prefix(activation_list, x->size, "an activation prefix")))
        return -1;
    return 0;
}

/* The s-th start, checked; -1 with an error set. */
static Py_ssize_t suffix_start(const Suffix *x, Py_ssize_t s) {
    Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(x->starts, s));
    if (i == -1 && PyErr_Occurred()) return -1;
    if (i < 0 || i >= x->size) {
        PyErr_SetString(PyExc_ValueError, "a start is past the layers");
        return -1;
    }
    return i;
}

/* Whether a stage of layers [i, end) holds its in-flight micro-batches in memory (memory only
 * grows with the range, so the first end that does not ends the rows). */
static int suffix_fits(const Suffix *x, Py_ssize_t i, Py_ssize_t end) {
    return !((x->fixed[end] - x->fixed[i]) + (double)x->own * (x->activation[end] - x->activation[i]) > x->memory);
}

/* The following front at `end`, read on first use (a suffix's states read few of them, and many
 * times); NULL with an error set. */
static Numbers *suffix_following(Suffix *x, Py_ssize_t end) {
    Numbers *next = &x->fronts[end];
    if (!next->values) {
        PyObject *list = PyList_GET_ITEM(x->following, end);
        if (!PyList_Check(list)) {
            PyErr_SetString(PyExc_TypeError, "a following front is a list (worked out before this stage's)");
            return NULL;
        }
        if (read_front(list, next) < 0) return NULL;
    }
    return next;
}

/* The crossing of codec c at `end`, read on first use; NULL with an error set. */
static Crossing *suffix_crossing(Suffix *x, Py_ssize_t end, Py_ssize_t c) {
    Crossing *at = &x->crossing[end * x->num_codecs + c];
    if (!at->codec) {
        if (c >= PyList_GET_SIZE(x->crossings)) {
            PyErr_SetString(PyExc_RuntimeError, "the crossings changed while they were read");
            return NULL;
        }
        if (read_crossing(PyList_GET_ITEM(x->crossings, c), end, at) < 0) return NULL;
    }
    return at;
}

/* suffix_fronts(starts, time, static, activation, memory, own, M, deepens, crossings, following, last_end)
 * -> [front of the state (this stage and the ones after it, first layer i) for i in starts]:
 * cut_front.py's suffix_fronts_python, the rows built here rather than one call per state. */
static PyObject *suffix_fronts(PyObject *self, PyObject *args) {
    Suffix x = {0};
    PyObject *time_list, *static_list, *activation_list;
    int deepens;
    if (!PyArg_ParseTuple(args, "O!OOOdnnpO!O!n", &PyList_Type, &x.starts, &time_list, &static_list, &activation_list,
                          &x.memory, &x.own, &x.M, &deepens, &PyList_Type, &x.crossings, &PyList_Type, &x.following,
                          &x.last_end))
        return NULL;
    State state = {{NULL, 0, 0}, {NULL, 0, 0}, {NULL, 0, 0}};
    /* read before the first object is made: making one can run the cyclic GC, whose finalizers
     * may change the lists (tests/planning/test_cut_front.py) */
    PyObject *out = NULL;
    if (suffix_read(&x, time_list, static_list, activation_list) < 0 || !(out = PyList_New(0))) goto fail;
    for (Py_ssize_t s = 0; s < PyList_GET_SIZE(x.starts); s++) {
        Py_ssize_t i = suffix_start(&x, s), order = 0;
        if (i < 0) goto fail;
        state.front.n = 0;
        for (Py_ssize_t end = i + 1; end <= x.last_end && suffix_fits(&x, i, end); end++) {
            Numbers *next = suffix_following(&x, end);
            if (!next) goto fail;
            if (next->n == 0) continue;
            Py_ssize_t window = x.own;
            if (deepens) { /* cut_front.suffix_rows: the deepest window memory allows the range */
                double per_mb = x.activation[end] - x.activation[i], held = x.fixed[end] - x.fixed[i];
                Py_ssize_t deepest = x.M;
                if (per_mb > 0) {
                    double most = floor_divide(x.memory - held, per_mb);
                    if (most < (double)x.M) deepest = (Py_ssize_t)most;
                }
                window = deepest > x.own ? deepest : x.own;
            }
            double t = x.acc[end] - x.acc[i];
            for (Py_ssize_t c = 0; c < x.num_codecs; c++) {
                Crossing *at = suffix_crossing(&x, end, c);
                if (!at || add_row_points(&state, next, end, t, (double)window, at, &order) < 0) goto fail;
            }
        }
        if (append_front(&state, out) < 0) goto fail;
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    state_free(&state);
    suffix_free(&x);
    return out;
}

/* Whether x sorts before y by (compute max, link max, sum, order made): the order of
 * cut_front.pareto_three_terms' stable sort. */
static int by_three_terms(const void *a, const void *b) {
    const Point *x = a, *y = b;
    if (x->compute != y->compute) return x->compute < y->compute ? -1 : 1;
    if (x->link != y->link) return x->link < y->link ? -1 : 1;
    if (x->total != y->total) return x->total < y->total ? -1 : 1;
    return (x->order > y->order) - (x->order < y->order);
}

/* The points of `all` (sorted by by_three_terms) that no earlier kept point beats or ties on both
 * the link max and the sum, moved to the front of `all`; returns how many. The kept points' (link,
 * sum) pairs that no other kept pair beats on both form a staircase: links rising, sums falling.
 * The kept pairs with a link at or below a point's are a prefix of it, whose least sum is its last
 * entry's, so one bisection answers what cut_front.pareto_three_terms asks of every kept point. */
static Py_ssize_t keep_three_term_front(Points *all, double *stair_link, double *stair_total) {
    Py_ssize_t kept = 0, steps = 0;
    for (Py_ssize_t k = 0; k < all->n; k++) {
        Point *p = &all->items[k];
        Py_ssize_t lo = 0, hi = steps; /* the first entry whose link is above p's */
        while (lo < hi) {
            Py_ssize_t mid = lo + (hi - lo) / 2;
            if (stair_link[mid] <= p->link)
                lo = mid + 1;
            else
                hi = mid;
        }
        if (lo > 0 && stair_total[lo - 1] <= p->total) continue; /* beaten or tied on both */
        all->items[kept++] = *p;
        Py_ssize_t past = lo; /* the entries after it that it beats or ties on both leave */
        while (past < steps && stair_total[past] >= p->total) past++;
        memmove(&stair_link[lo + 1], &stair_link[past], sizeof(double) * (steps - past));
        memmove(&stair_total[lo + 1], &stair_total[past], sizeof(double) * (steps - past));
        steps += lo + 1 - past;
        stair_link[lo] = p->link;
        stair_total[lo] = p->total;
    }
    return kept;
}

/* three_term_fronts(starts, time, static, activation, memory, own, M, crossings, following, last_end)
 * -> [front of the state (this stage and the ones after it, first layer i) for i in starts] where
 * the closed form keeps compute, link and the round trip apart (GPipe, ZB-H1, ZB-H2: no window
 * term): cut_front.three_term_fronts_python, the same arithmetic, order and ties. In Python the
 * points and the front of each state were nearly all of planning 6 nodes and 48 layers under ZB-H1
 * (16 CPU s; 49 s with compression auto). */
static PyObject *three_term_fronts(PyObject *self, PyObject *args) {
    Suffix x = {0};
    PyObject *time_list, *static_list, *activation_list;
    if (!PyArg_ParseTuple(args, "O!OOOdnnO!O!n", &PyList_Type, &x.starts, &time_list, &static_list, &activation_list,
                          &x.memory, &x.own, &x.M, &PyList_Type, &x.crossings, &PyList_Type, &x.following, &x.last_end))
        return NULL;
    double *stair_link = NULL, *stair_total = NULL;
    State state = {{NULL, 0, 0}, {NULL, 0, 0}, {NULL, 0, 0}}; /* its front holds a state's points */
    /* read before the first object is made: making one can run the cyclic GC, whose finalizers
     * may change the lists (tests/planning/test_cut_front.py) */
    PyObject *out = NULL;
    if (suffix_read(&x, time_list, static_list, activation_list) < 0 || !(out = PyList_New(0))) goto fail;
    for (Py_ssize_t s = 0; s < PyList_GET_SIZE(x.starts); s++) {
        Py_ssize_t i = suffix_start(&x, s), order = 0;
        if (i < 0) goto fail;
        Points *all = &state.front;
        all->n = 0;
        for (Py_ssize_t end = i + 1; end <= x.last_end && suffix_fits(&x, i, end); end++) {
            Numbers *next = suffix_following(&x, end);
            if (!next) goto fail;
            if (next->n == 0) continue;
            double t = x.acc[end] - x.acc[i];
            for (Py_ssize_t c = 0; c < x.num_codecs; c++) {
                Crossing *at = suffix_crossing(&x, end, c);
                if (!at || reserve(all, next->n) < 0) goto fail;
                double tc = t + at->work;
                /* cut_front.state_points with no window term. The points whose compute and link are
                 * this stage's and this crossing's (the following point's are at or below them) share
                 * both terms: of them only the first with the least sum can be kept (the others sort
                 * after it with a sum at or above its own), so the others are not made. */
                Py_ssize_t shared = -1; /* where the kept one of them is */
                for (Py_ssize_t k = 0; k < next->n; k++, order++) {
                    const double *p = &next->values[4 * k];
                    double total = p[3] + tc + 2 * (at->latency + at->link);
                    int below = !(p[0] > tc) && !(p[1] > at->link);
                    if (below && shared >= 0 && !(total < all->items[shared].total)) continue;
                    Point *q = &all->items[below && shared >= 0 ? shared : all->n++];
                    if (below) shared = q - all->items;
                    q->total = total;
                    q->compute = pmax(p[0], tc);
                    q->link = pmax(p[1], at->link);
                    q->window = p[2];
                    q->key = 0.0;
                    q->end = end;
                    q->next = k;
                    q->order = order;
                    q->codec = at->codec;
                }
            }
        }
        qsort(all->items, all->n, sizeof(Point), by_three_terms);
        PyMem_Free(stair_link);
        PyMem_Free(stair_total);
        stair_link = PyMem_Malloc(sizeof(double) * (all->n ? all->n : 1));
        stair_total = PyMem_Malloc(sizeof(double) * (all->n ? all->n : 1));
        if (!stair_link || !stair_total) {
            PyErr_NoMemory();
            goto fail;
        }
        all->n = keep_three_term_front(all, stair_link, stair_total);
        if (append_front(&state, out) < 0) goto fail;
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    state_free(&state);
    suffix_free(&x);
    PyMem_Free(stair_link);
    PyMem_Free(stair_total);
    return out;
}

static PyMethodDef methods[] = {
    {"one_bottleneck_front", one_bottleneck_front, METH_VARARGS,
     "one_bottleneck_front(rows, crossings) -> the Pareto front of a cut state under 1F1B"},
    {"suffix_fronts", suffix_fronts, METH_VARARGS,
     "suffix_fronts(starts, time, static, activation, memory, own, M, deepens, crossings, following, last_end) "
     "-> the fronts of a suffix's states at those starts under 1F1B"},
    {"three_term_fronts", three_term_fronts, METH_VARARGS,
     "three_term_fronts(starts, time, static, activation, memory, own, M, crossings, following, last_end) "
     "-> the fronts of a suffix's states at those starts where compute, link and round trip are priced apart"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cutfront",
                                    "launcher/planning/cut_front.py's loop, compiled (same arithmetic).", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cutfront(void) { return PyModule_Create(&module); }
