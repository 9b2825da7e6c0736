/* Numbers read out of Python lists and tuples by the planner's compiled loops (_cutfront.c,
 * _bottleneck.c, _floors.c). */
#ifndef HETLAUNCH_PY_NUMBERS_H
#define HETLAUNCH_PY_NUMBERS_H

#include <Python.h>

/* A float or an int only: converting anything else could run Python code (__float__) that changes
 * the lists being read while their sizes and borrowed items are held. `what` names the numbers in
 * the TypeError ("a cut front's"). */
static int as_double(PyObject *item, double *out, const char *what) {
    if (PyFloat_Check(item)) {
        *out = PyFloat_AS_DOUBLE(item);
        return 0;
    }
    if (PyLong_Check(item)) {
        *out = PyLong_AsDouble(item);
        return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
    }
    PyErr_Format(PyExc_TypeError, "%s numbers are floats or ints", what);
    return -1;
}

#endif
