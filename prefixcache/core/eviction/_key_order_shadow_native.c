/* A shadow cache in a key order, in C: what liveness_order.py's ShadowLivenessOrder keeps.
 *
 * KeyOrderShadow holds at most `capacity` hashes, each with a class, a clock and a key,
 * and evicts the lowest (key, order) first, the order counting insertions. It knows
 * nothing of the model behind the keys: the caller gives each access's key, and new
 * log-odds per class at a re-key (key = log-odds of the class, or the overall one for a
 * class below 0, plus the clock: the same double addition as the Python code, so the same
 * keys to the last bit). ShadowLivenessOrder in Python is the reference
 * (tests/core/test_liveness_order.py runs both). Keys must be exact bytes; the type holds
 * no other Python object, so it needs no cycle collection. Entries sit in an indexed
 * binary heap, so a hash given again is moved, not left behind.
 */
#include "_keyed_table.h"
#include <structmember.h>

typedef struct {
    KeyedEntry keyed; /* its list links are unused: the heap carries the order */
    double key, clock;
    long long order;
    Py_ssize_t finest_class;
    Py_ssize_t heap_position;
} Entry;

typedef struct {
    PyObject_HEAD
    Py_ssize_t capacity;
    double num_hits;
    long long order;
    KeyedTable table;
    Py_ssize_t *heap; /* entry indices, a binary min-heap on (key, order) */
    Py_ssize_t heap_size, heap_allocated;
} Shadow;

static inline Entry *
entry(Shadow *self, Py_ssize_t index)
{
    return (Entry *)keyed_entry(&self->table, index);
}

/* -- the heap ------------------------------------------------------------------------- */

static inline int
lower(Shadow *self, Py_ssize_t a, Py_ssize_t b)
{
    Entry *x = entry(self, a), *y = entry(self, b);
    return x->key < y->key || (x->key == y->key && x->order < y->order);
}

static inline void
heap_place(Shadow *self, Py_ssize_t position, Py_ssize_t index)
{
    self->heap[position] = index;
    entry(self, index)->heap_position = position;
}

static void
sift_up(Shadow *self, Py_ssize_t position)
{
    Py_ssize_t index = self->heap[position];
    while (position > 0) {
        Py_ssize_t parent = (position - 1) / 2;
        if (!lower(self, index, self->heap[parent]))
            break;
        heap_place(self, position, self->heap[parent]);
        position = parent;
    }
    heap_place(self, position, index);
}

static void
sift_down(Shadow *self, Py_ssize_t position)
{
    Py_ssize_t index = self->heap[position], size = self->heap_size;
    for (;;) {
        Py_ssize_t child = 2 * position + 1;
        if (child >= size)
            break;
        if (child + 1 < size && lower(self, self->heap[child + 1], self->heap[child]))
            child++;
        if (!lower(self, self->heap[child], index))
            break;
        heap_place(self, position, self->heap[child]);
        position = child;
    }
    heap_place(self, position, index);
}

static int
heap_reserve(Shadow *self)
{
    if (self->heap_size < self->heap_allocated)
        return 0;
    Py_ssize_t n = self->heap_allocated ? self->heap_allocated * 2 : 64;
    if ((size_t)n > PY_SSIZE_T_MAX / sizeof(Py_ssize_t)) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t *heap = PyMem_Realloc(self->heap, (size_t)n * sizeof(Py_ssize_t));
    if (heap == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->heap = heap;
    self->heap_allocated = n;
    return 0;
}

/* Take the lowest entry out of the heap and the table. */
static void
evict_lowest(Shadow *self)
{
    Py_ssize_t index = self->heap[0];
    Py_ssize_t last = self->heap[--self->heap_size];
    if (self->heap_size > 0) {
        heap_place(self, 0, last);
        sift_down(self, 0);
    }
    keyed_table_delete(&self->table, index);
}

/* -- the type ------------------------------------------------------------------------- */

static PyObject *
Shadow_new(PyTypeObject *type, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kwds))
{
    Shadow *self = (Shadow *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    if (keyed_table_init(&self->table, sizeof(Entry)) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void
forget_all(Shadow *self)
{
    keyed_table_clear(&self->table);
    self->heap_size = 0;
}

static int
Shadow_init(Shadow *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"capacity", NULL};
    Py_ssize_t capacity;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n", kwlist, &capacity))
        return -1;
    forget_all(self);
    self->capacity = capacity < 1 ? 1 : capacity;
    self->num_hits = 0.0;
    self->order = 0;
    return 0;
}

static void
Shadow_dealloc(Shadow *self)
{
    if (self->table.entries != NULL)
        keyed_table_clear(&self->table);
    keyed_table_free(&self->table);
    PyMem_Free(self->heap);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(access_doc,
"access(hashes, finest_class, clock, key, num_shared=0, shared_class=-1, shared_key=0.0)\n"
"-> int\n\n"
"One request's sampled hashes (distinct bytes), prefix first: count the held ones as\n"
"hits, then hold each with this clock and with this class and key, or, for the first\n"
"num_shared, with shared_class and shared_key; the deepest entered first; then evict\n"
"the lowest (key, order) while more than capacity are held. Returns the hits. After an\n"
"error (a hash that is not exact bytes) the shadow is whole but may hold part of the\n"
"request, uncounted.");

static PyObject *
Shadow_access(Shadow *self, PyObject *args)
{
    PyObject *hashes;
    Py_ssize_t finest_class, num_shared = 0, shared_class = -1;
    double clock, key, shared_key = 0.0;
    if (!PyArg_ParseTuple(args, "Ondd|nnd", &hashes, &finest_class, &clock, &key,
                          &num_shared, &shared_class, &shared_key))
        return NULL;
    PyObject *sequence = PySequence_Fast(hashes, "hashes must be a sequence of bytes");
    if (sequence == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(sequence);
    PyObject **items = PySequence_Fast_ITEMS(sequence);
    Py_ssize_t num_hits = 0;
    int failed = 0;
    keyed_table_prefetch_keys(&self->table, items, n);
    for (Py_ssize_t k = 0; k < n; k++) { /* hits first: what was held before the request */
        PyObject *block_hash = items[k];
        if (!PyBytes_CheckExact(block_hash)) {
            PyErr_Format(PyExc_TypeError, "a shadow's hashes must be bytes, not %.100s",
                         Py_TYPE(block_hash)->tp_name);
            Py_DECREF(sequence);
            return NULL;
        }
        size_t slot;
        if (keyed_table_find(&self->table, block_hash, PyObject_Hash(block_hash), &slot)
                != NONE)
            num_hits++;
    }
    for (Py_ssize_t k = n - 1; k >= 0 && !failed; k--) { /* the deepest first */
        PyObject *block_hash = items[k];
        Py_hash_t hash = PyObject_Hash(block_hash);
        if (keyed_table_make_room(&self->table) < 0 || heap_reserve(self) < 0) {
            failed = 1;
            break;
        }
        size_t slot;
        Py_ssize_t index = keyed_table_find(&self->table, block_hash, hash, &slot);
        int is_new = index == NONE;
        if (is_new)
            index = keyed_table_insert(&self->table, block_hash, hash, slot);
        Entry *e = entry(self, index);
        int shared = k < num_shared;
        e->key = shared ? shared_key : key;
        e->clock = clock;
        e->finest_class = shared ? shared_class : finest_class;
        e->order = ++self->order;
        if (is_new) {
            heap_place(self, self->heap_size++, index);
            sift_up(self, e->heap_position);
        }
        else { /* its class may have changed: the key may move either way */
            sift_down(self, e->heap_position);
            sift_up(self, e->heap_position);
        }
    }
    while (!failed && self->heap_size > self->capacity)
        evict_lowest(self);
    Py_DECREF(sequence);
    if (failed)
        return NULL;
    self->num_hits += (double)num_hits;
    return PyLong_FromSsize_t(num_hits);
}

PyDoc_STRVAR(rekey_doc,
"rekey(class_log_odds, overall_log_odds)\n\n"
"Key every entry again: class_log_odds[its class] (a list of floats), or\n"
"overall_log_odds for a class below 0, plus its clock.");

static PyObject *
Shadow_rekey(Shadow *self, PyObject *args)
{
    PyObject *log_odds;
    double overall;
    if (!PyArg_ParseTuple(args, "O!d", &PyList_Type, &log_odds, &overall))
        return NULL;
    Py_ssize_t num_classes = PyList_GET_SIZE(log_odds);
    for (Py_ssize_t k = 0; k < self->heap_size; k++) {
        Entry *e = entry(self, self->heap[k]);
        double class_log_odds = overall;
        if (e->finest_class >= 0) {
            if (e->finest_class >= num_classes) {
                PyErr_SetString(PyExc_IndexError, "a class held has no log-odds");
                return NULL;
            }
            class_log_odds = PyFloat_AsDouble(PyList_GET_ITEM(log_odds, e->finest_class));
            if (class_log_odds == -1.0 && PyErr_Occurred())
                return NULL;
        }
        e->key = class_log_odds + e->clock;
    }
    for (Py_ssize_t k = self->heap_size / 2 - 1; k >= 0; k--)
        sift_down(self, k);
    Py_RETURN_NONE;
}

static PyObject *
Shadow_forget(Shadow *self, PyObject *Py_UNUSED(ignored))
{
    forget_all(self);
    Py_RETURN_NONE;
}

/* The hashes held, next to evict first (a list; for tests). */
static PyObject *
Shadow_keys_in_order(Shadow *self, PyObject *Py_UNUSED(ignored))
{
    Py_ssize_t n = self->heap_size;
    PyObject *keys = PyList_New(n);
    if (keys == NULL)
        return NULL;
    /* Pop a copy of the heap: sorting by (key, order) is the eviction order. */
    Py_ssize_t *saved = PyMem_Malloc((n ? n : 1) * sizeof(Py_ssize_t));
    if (saved == NULL) {
        Py_DECREF(keys);
        return PyErr_NoMemory();
    }
    memcpy(saved, self->heap, n * sizeof(Py_ssize_t));
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t index = self->heap[0];
        PyList_SET_ITEM(keys, k, Py_NewRef(entry(self, index)->keyed.key));
        Py_ssize_t last = self->heap[--self->heap_size];
        if (self->heap_size > 0) {
            heap_place(self, 0, last);
            sift_down(self, 0);
        }
    }
    self->heap_size = n;
    for (Py_ssize_t k = 0; k < n; k++)
        heap_place(self, k, saved[k]);
    PyMem_Free(saved);
    return keys;
}

static Py_ssize_t
Shadow_len(Shadow *self)
{
    return self->heap_size;
}

static PyMethodDef Shadow_methods[] = {
    {"access", (PyCFunction)Shadow_access, METH_VARARGS, access_doc},
    {"rekey", (PyCFunction)Shadow_rekey, METH_VARARGS, rekey_doc},
    {"forget", (PyCFunction)Shadow_forget, METH_NOARGS, "Drop every hash held."},
    {"keys_in_order", (PyCFunction)Shadow_keys_in_order, METH_NOARGS,
     "The hashes held, next to evict first."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Shadow_members[] = {
    {"capacity", T_PYSSIZET, offsetof(Shadow, capacity), READONLY, NULL},
    {"num_hits", T_DOUBLE, offsetof(Shadow, num_hits), 0,
     "hits counted so far; the caller may scale it (decay)"},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods Shadow_as_sequence = {
    .sq_length = (lenfunc)Shadow_len,
};

static PyTypeObject ShadowType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "prefixcache.core.eviction._key_order_shadow_native.KeyOrderShadow",
    .tp_basicsize = sizeof(Shadow),
    .tp_dealloc = (destructor)Shadow_dealloc,
    .tp_as_sequence = &Shadow_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "KeyOrderShadow(capacity)\n\nThe hashes and keys of liveness_order.py's "
              "ShadowLivenessOrder, in C (keys are exact bytes).",
    .tp_methods = Shadow_methods,
    .tp_members = Shadow_members,
    .tp_init = (initproc)Shadow_init,
    .tp_new = Shadow_new,
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "prefixcache.core.eviction._key_order_shadow_native",
    .m_doc = "The liveness order's shadow cache in C (see liveness_order.py).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__key_order_shadow_native(void)
{
    if (PyType_Ready(&ShadowType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    Py_INCREF(&ShadowType);
    if (PyModule_AddObject(module, "KeyOrderShadow", (PyObject *)&ShadowType) < 0) {
        Py_DECREF(&ShadowType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
