/* document-liveness's EM fit in C.
 *
 * fit() computes exactly what DocumentLivenessModel._fit_in_python computes
 * (document_liveness_model.py is the reference and says what the fit estimates): the
 * same operations on the same doubles in the same order, so the estimates agree to the
 * last bit (tests/core/test_document_liveness.py holds the two equal). No fused
 * multiply-adds (setup.py compiles this file with -ffp-contract=off) and the C library's
 * exp(), which is what Python's math.exp() calls. It exists for speed: the fit runs
 * every few finished requests over up to max_states states, several passes each, and in
 * Python that loop costs more than the rest of the policy.
 *
 * Every input is read once into C arrays; nothing is kept between calls. The states come
 * in arrays of 64-bit ints (array('q')), read through the buffer protocol: they are most
 * of the input, and converting a list's Python ints one by one cost more than the EM.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define NUM_LEVELS 3

/* A Python list of ints into a new C array of n longs (NULL and an exception on error). */
static long *
read_longs(PyObject *list, Py_ssize_t n, const char *name)
{
    if (!PyList_Check(list) || PyList_GET_SIZE(list) != n) {
        PyErr_Format(PyExc_ValueError, "%s must be a list of %zd ints", name, n);
        return NULL;
    }
    long *values = PyMem_Malloc(sizeof(long) * (size_t)(n ? n : 1));
    if (values == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        values[i] = PyLong_AsLong(PyList_GET_ITEM(list, i));
        if (values[i] == -1 && PyErr_Occurred()) {
            PyMem_Free(values);
            return NULL;
        }
    }
    return values;
}

/* An object exporting a one-dimensional contiguous buffer of 64-bit ints (format "q", as
 * array('q') does) into a new C array of longs; its length in *n if n_known is 0, else it
 * must be *n. NULL and an exception on error. */
static long *
read_int64s(PyObject *object, Py_ssize_t *n, int n_known, const char *name)
{
    Py_buffer view;
    if (PyObject_GetBuffer(object, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) { /* no buffer at all */
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s must be an array('q')", name);
        }
        return NULL;
    }
    long *values = NULL;
    Py_ssize_t count = view.len / (Py_ssize_t)sizeof(long long);
    if (view.ndim != 1 || view.itemsize != (Py_ssize_t)sizeof(long long)
            || view.format == NULL || strcmp(view.format, "q") != 0
            || (n_known && count != *n)) {
        PyErr_Format(PyExc_ValueError, "%s must be an array('q') of one int per state", name);
        goto done;
    }
    values = PyMem_Malloc(sizeof(long) * (size_t)(count ? count : 1));
    if (values == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const long long *items = view.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (items[i] < LONG_MIN || items[i] > LONG_MAX) { /* where long is 32 bits */
            PyErr_Format(PyExc_OverflowError, "%s holds an int too large", name);
            PyMem_Free(values);
            values = NULL;
            goto done;
        }
        values[i] = (long)items[i];
    }
    *n = count;
done:
    PyBuffer_Release(&view);
    return values;
}

/* A Python list of floats into a new C array of n doubles. */
static double *
read_doubles(PyObject *list, Py_ssize_t n, const char *name)
{
    if (!PyList_Check(list) || PyList_GET_SIZE(list) != n) {
        PyErr_Format(PyExc_ValueError, "%s must be a list of %zd floats", name, n);
        return NULL;
    }
    double *values = PyMem_Malloc(sizeof(double) * (size_t)(n ? n : 1));
    if (values == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        values[i] = PyFloat_AsDouble(PyList_GET_ITEM(list, i));
        if (values[i] == -1.0 && PyErr_Occurred()) {
            PyMem_Free(values);
            return NULL;
        }
    }
    return values;
}

static PyObject *
list_of_doubles(const double *values, Py_ssize_t n)
{
    PyObject *list = PyList_New(n);
    if (list == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *value = PyFloat_FromDouble(values[i]);
        if (value == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, value);
    }
    return list;
}

PyDoc_STRVAR(fit_doc,
"fit(starts, continued_at, classes, parents, leaf_p, rates, now, origin, width,\n"
"    prior_weight, overall, iterations) -> (leaf_p, overall, rates)\n\n"
"DocumentLivenessModel._fit_in_python's EM, to the last bit. starts: each state's\n"
"start; continued_at: when it continued, or -1; classes: a tuple of three, each state's\n"
"class id at each level, coarsest first (these five: arrays of 64-bit ints, format\n"
"'q'); parents: per level, coarsest first, each class's parent one level\n"
"up (-1 at the coarsest); leaf_p: p per finest class to start from; rates: per bin,\n"
"from the bin holding origin; now: the current time; width: releases per bin.");

static PyObject *
fit(PyObject *module, PyObject *args)
{
    PyObject *starts_array, *continued_array, *classes_tuple, *parents_list, *leaf_list;
    PyObject *rates_list;
    long now, origin, width;
    double prior_weight, overall;
    int iterations;
    if (!PyArg_ParseTuple(args, "OOO!O!O!O!lllddi", &starts_array, &continued_array,
                          &PyTuple_Type, &classes_tuple, &PyList_Type, &parents_list,
                          &PyList_Type, &leaf_list, &PyList_Type, &rates_list, &now,
                          &origin, &width, &prior_weight, &overall, &iterations))
        return NULL;
    Py_ssize_t n = 0;
    Py_ssize_t num_bins = PyList_GET_SIZE(rates_list);
    Py_ssize_t num_leaves = PyList_GET_SIZE(leaf_list);
    if (width < 1 || num_bins < 1 || now < origin
            || PyTuple_GET_SIZE(classes_tuple) != NUM_LEVELS
            || PyList_GET_SIZE(parents_list) != NUM_LEVELS) {
        PyErr_SetString(PyExc_ValueError, "fit: inconsistent window, classes or parents");
        return NULL;
    }
    long span = now - origin + 1; /* the releases the states span, from offset 0 */
    long *starts = NULL, *continued_at = NULL, *classes = NULL, *parents[NUM_LEVELS] = {0};
    long *level_classes[NUM_LEVELS] = {0};
    long *events = NULL, *trials = NULL, *bin_ends = NULL, *waiting = NULL;
    long *start_offsets = NULL, *end_offsets = NULL;
    double *leaf_p = NULL, *rates = NULL, *weights = NULL, *at_bin_start = NULL;
    double *successes = NULL, *estimates[NUM_LEVELS] = {0}, *change = NULL, *exposure = NULL;
    Py_ssize_t num_classes[NUM_LEVELS];
    PyObject *result = NULL;

    starts = read_int64s(starts_array, &n, 0, "starts");
    continued_at = starts ? read_int64s(continued_array, &n, 1, "continued_at") : NULL;
    leaf_p = continued_at ? read_doubles(leaf_list, num_leaves, "leaf_p") : NULL;
    rates = leaf_p ? read_doubles(rates_list, num_bins, "rates") : NULL;
    if (rates == NULL)
        goto done;
    for (int level = 0; level < NUM_LEVELS; level++) {
        PyObject *level_parents = PyList_GET_ITEM(parents_list, level);
        if (!PyList_Check(level_parents)) {
            PyErr_SetString(PyExc_ValueError, "fit: parents must be lists");
            goto done;
        }
        num_classes[level] = PyList_GET_SIZE(level_parents);
        parents[level] = read_longs(level_parents, num_classes[level], "parents");
        if (parents[level] == NULL)
            goto done;
        for (Py_ssize_t c = 0; level > 0 && c < num_classes[level]; c++)
            if (parents[level][c] < 0 || parents[level][c] >= num_classes[level - 1]) {
                PyErr_SetString(PyExc_ValueError, "fit: a parent out of range");
                goto done;
            }
    }
    if (num_classes[NUM_LEVELS - 1] != num_leaves) {
        PyErr_SetString(PyExc_ValueError, "fit: one p per finest class");
        goto done;
    }
    classes = PyMem_Malloc(sizeof(long) * NUM_LEVELS * (size_t)(n ? n : 1));
    if (classes == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (int level = 0; level < NUM_LEVELS; level++) {
        level_classes[level] = read_int64s(PyTuple_GET_ITEM(classes_tuple, level), &n, 1,
                                           "classes");
        if (level_classes[level] == NULL)
            goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        for (int level = 0; level < NUM_LEVELS; level++) {
            long id = level_classes[level][i];
            if (id < 0 || id >= num_classes[level]) {
                PyErr_SetString(PyExc_ValueError, "fit: a class id out of range");
                goto done;
            }
            classes[i * NUM_LEVELS + level] = id;
        }
        long start = starts[i] - origin, end = (continued_at[i] >= 0 ? continued_at[i] : now)
                                                - origin;
        if (start < 0 || end < start || end >= span) {
            PyErr_SetString(PyExc_ValueError, "fit: a state outside the window");
            goto done;
        }
    }

    Py_ssize_t largest_level = num_classes[0];
    for (int level = 1; level < NUM_LEVELS; level++)
        if (num_classes[level] > largest_level)
            largest_level = num_classes[level];
    size_t n_alloc = (size_t)(n ? n : 1), bins_alloc = (size_t)num_bins;
    events = PyMem_Calloc(bins_alloc, sizeof(long));
    bin_ends = PyMem_Malloc(sizeof(long) * bins_alloc);
    trials = PyMem_Calloc((size_t)NUM_LEVELS * (size_t)(largest_level + 1), sizeof(long));
    waiting = PyMem_Malloc(sizeof(long) * 5 * n_alloc);
    weights = PyMem_Malloc(sizeof(double) * n_alloc);
    at_bin_start = PyMem_Malloc(sizeof(double) * (bins_alloc + 1));
    successes = PyMem_Malloc(sizeof(double) * NUM_LEVELS * (size_t)(largest_level + 1));
    start_offsets = PyMem_Malloc(sizeof(long) * n_alloc);
    end_offsets = PyMem_Malloc(sizeof(long) * n_alloc);
    change = PyMem_Malloc(sizeof(double) * (size_t)(span + 1));
    exposure = PyMem_Malloc(sizeof(double) * bins_alloc);
    for (int level = 0; level < NUM_LEVELS; level++)
        estimates[level] = PyMem_Malloc(sizeof(double) * (size_t)(num_classes[level] + 1));
    if (!events || !bin_ends || !trials || !waiting || !weights || !at_bin_start || !successes
            || !start_offsets || !end_offsets || !change || !exposure || !estimates[0]
            || !estimates[1] || !estimates[2]) {
        PyErr_NoMemory();
        goto done;
    }

    /* What is the same in every iteration: each state's start and end as offsets from
     * the origin, each waiting state's bins (the last bin's rate runs on beyond it), the
     * continuations per bin, the trials per class. */
    long last_bin = (long)num_bins - 1;
    Py_ssize_t num_waiting = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        long start = starts[i] - origin;
        start_offsets[i] = start;
        end_offsets[i] = (continued_at[i] >= 0 ? continued_at[i] : now) - origin;
        if (continued_at[i] >= 0) {
            long bin = (continued_at[i] - origin) / width;
            if (bin > last_bin) {
                PyErr_SetString(PyExc_ValueError, "fit: fewer rates than bins");
                goto done;
            }
            events[bin] += 1;
        } else {
            long end = now - origin;
            long start_bin = start / width < last_bin ? start / width : last_bin;
            long end_bin = end / width < last_bin ? end / width : last_bin;
            long *w = &waiting[num_waiting * 5];
            w[0] = (long)i;
            w[1] = start_bin;
            w[2] = start - start_bin * width;
            w[3] = end_bin;
            w[4] = end - end_bin * width;
            num_waiting++;
        }
        for (int level = 0; level < NUM_LEVELS; level++)
            trials[level * (largest_level + 1) + classes[i * NUM_LEVELS + level]] += 1;
    }
    for (Py_ssize_t j = 0; j < num_bins; j++)
        bin_ends[j] = (j + 1) * width < span ? (long)(j + 1) * width : span;

    double *leaf = leaf_p; /* the current finest estimates: leaf_p, then estimates[2] */
    for (int iteration = 0; iteration < iterations; iteration++) {
        /* E: the chance each waiting state's document is still alive. */
        at_bin_start[0] = 0.0;
        for (Py_ssize_t j = 0; j < num_bins; j++)
            at_bin_start[j + 1] = at_bin_start[j] + rates[j] * (double)width;
        for (Py_ssize_t i = 0; i < n; i++)
            weights[i] = 1.0;
        for (Py_ssize_t k = 0; k < num_waiting; k++) {
            const long *w = &waiting[k * 5];
            double p = leaf[classes[w[0] * NUM_LEVELS + 2]];
            double from = at_bin_start[w[1]] + rates[w[1]] * (double)w[2];
            double to = at_bin_start[w[3]] + rates[w[3]] * (double)w[4];
            double alive = p * exp(from - to);
            double rest = alive + 1.0 - p;
            weights[w[0]] = alive / (1e-12 > rest ? 1e-12 : rest);
        }
        /* M: every sum over the states in one pass (each sum still adds its terms in
         * state order, so each is the same double as a loop of its own gives): the
         * total, the successes per class at each level, and the change in the expected
         * alive count at each release. */
        double total = 0.0;
        for (Py_ssize_t c = 0; c < NUM_LEVELS * (largest_level + 1); c++)
            successes[c] = 0.0;
        for (long offset = 0; offset <= span; offset++)
            change[offset] = 0.0;
        for (Py_ssize_t i = 0; i < n; i++) {
            double weight = weights[i];
            const long *path = &classes[i * NUM_LEVELS];
            total += weight;
            for (int level = 0; level < NUM_LEVELS; level++)
                successes[level * (largest_level + 1) + path[level]] += weight;
            change[start_offsets[i]] += weight;
            change[end_offsets[i]] -= weight;
        }
        /* p per class, each shrunk towards its parent's. */
        overall = (total + 1.0) / ((double)n + 2.0);
        for (int level = 0; level < NUM_LEVELS; level++) {
            const double *level_successes = &successes[level * (largest_level + 1)];
            const long *level_trials = &trials[level * (largest_level + 1)];
            for (Py_ssize_t c = 0; c < num_classes[level]; c++) {
                double prior = level == 0 ? overall : estimates[level - 1][parents[level][c]];
                estimates[level][c] = (level_successes[c] + prior_weight * prior)
                                      / ((double)level_trials[c] + prior_weight);
            }
        }
        leaf = estimates[2];
        /* The rate per bin, continuations over the expected alive exposure. */
        double alive_count = 0.0;
        long offset = 0;
        for (Py_ssize_t j = 0; j < num_bins; j++) {
            double in_bin = 0.0;
            for (; offset < bin_ends[j]; offset++) {
                alive_count += change[offset];
                in_bin += alive_count;
            }
            exposure[j] = in_bin;
        }
        for (Py_ssize_t j = 0; j < num_bins; j++)
            if (exposure[j] > 0)
                rates[j] = ((double)events[j] + 0.5) / (exposure[j] + 1.0);
    }

    PyObject *leaf_result = list_of_doubles(leaf, num_leaves);
    PyObject *rates_result = leaf_result ? list_of_doubles(rates, num_bins) : NULL;
    if (rates_result != NULL)
        result = Py_BuildValue("(NdN)", leaf_result, overall, rates_result);
    else
        Py_XDECREF(leaf_result);
done:
    PyMem_Free(starts);
    PyMem_Free(continued_at);
    PyMem_Free(classes);
    PyMem_Free(leaf_p);
    PyMem_Free(rates);
    PyMem_Free(events);
    PyMem_Free(trials);
    PyMem_Free(bin_ends);
    PyMem_Free(waiting);
    PyMem_Free(weights);
    PyMem_Free(at_bin_start);
    PyMem_Free(successes);
    PyMem_Free(start_offsets);
    PyMem_Free(end_offsets);
    PyMem_Free(change);
    PyMem_Free(exposure);
    for (int level = 0; level < NUM_LEVELS; level++) {
        PyMem_Free(parents[level]);
        PyMem_Free(level_classes[level]);
        PyMem_Free(estimates[level]);
    }
    return result;
}

static PyMethodDef module_methods[] = {
    {"fit", fit, METH_VARARGS, fit_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "prefixcache.core.eviction._liveness_fit_native",
    .m_doc = "document-liveness's EM fit in C (see document_liveness_model.py).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__liveness_fit_native(void)
{
    return PyModule_Create(&module_def);
}
