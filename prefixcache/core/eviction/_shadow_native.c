/* adaptive's shadow caches in C.
 *
 * ShadowSegmentedLRU here keeps the contract of PythonShadowSegmentedLRU in shadow.py,
 * which is the reference: the same segments in the same orders, the same hit counts,
 * decision for decision (tests/core/test_shadow_cache.py runs both against one model).
 * It exists for speed: adaptive feeds five shadows on every finished request, and in
 * Python their dictionary operations and the interpreter between them cost more than the
 * rest of the policy. Keys must be exact bytes (block hashes): hashing and comparing
 * them runs no Python code, and the type holds no reference that could lead back to it,
 * so it needs no cycle collection. A call made while another is under way on the same
 * shadow (from a low-reuse container's __contains__) raises RuntimeError.
 *
 * Layout (_keyed_table.h): every key held (in a segment or the ghost list) has one
 * entry, linked into one list per segment and one for the ghost, head = least recent.
 */
#include "_keyed_table.h"
#include <structmember.h>

/* Segments, evicted in this order: low-reuse, probation, protected. Then the ghost list
 * of evicted keys, and PENDING: unlinked, about to rejoin probation. */
enum { LOW_REUSE = 0, PROBATION = 1, PROTECTED = 2, GHOST = 3, NUM_LISTS = 4, PENDING = 4 };

typedef struct {
    KeyedEntry keyed;
    int list;
} Entry;

typedef struct {
    PyObject_HEAD
    Py_ssize_t capacity, max_ghost, max_protected;
    char low_reuse_first; /* a char: T_BOOL's size */
    char busy;            /* inside access: refuse calls that would change the shadow */
    double num_hits;
    KeyedTable table;
    KeyedList lists[NUM_LISTS];
} Shadow;

static inline Entry *
entry(Shadow *self, Py_ssize_t index)
{
    return (Entry *)keyed_entry(&self->table, index);
}

static void
list_append(Shadow *self, int list, Py_ssize_t index)
{
    entry(self, index)->list = list;
    keyed_list_append(&self->table, &self->lists[list], index);
}

static void
list_unlink(Shadow *self, Py_ssize_t index)
{
    Entry *e = entry(self, index);
    keyed_list_unlink(&self->table, &self->lists[e->list], index);
    e->list = PENDING;
}

static void
insert(Shadow *self, PyObject *key, Py_hash_t hash, size_t slot, int list)
{
    list_append(self, list, keyed_table_insert(&self->table, key, hash, slot));
}

/* Drop entry `index` (found by the caller): its place in a list, its slot, its key. */
static void
delete(Shadow *self, Py_ssize_t index)
{
    if (entry(self, index)->list != PENDING)
        list_unlink(self, index);
    keyed_table_delete(&self->table, index);
}

static void
forget_all(Shadow *self)
{
    keyed_table_clear(&self->table);
    for (int l = 0; l < NUM_LISTS; l++)
        self->lists[l] = KEYED_EMPTY_LIST;
}

/* -- the type ------------------------------------------------------------------------- */

static PyObject *
Shadow_new(PyTypeObject *type, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kwds))
{
    Shadow *self = (Shadow *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    /* tp_alloc zeroes the rest; the lists start empty, and with no table the object
     * refuses use until __init__ succeeds (check_ready). */
    for (int l = 0; l < NUM_LISTS; l++)
        self->lists[l] = KEYED_EMPTY_LIST;
    return (PyObject *)self;
}

static int
Shadow_init(Shadow *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"capacity", "protected_fraction", "low_reuse_first",
                             "ghost_factor", NULL};
    Py_ssize_t capacity, ghost_factor = 1;
    double protected_fraction;
    int low_reuse_first = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nd|pn", kwlist, &capacity,
                                     &protected_fraction, &low_reuse_first, &ghost_factor))
        return -1;
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the shadow is in the middle of an access");
        return -1;
    }
    if (ghost_factor < 0) {
        PyErr_SetString(PyExc_ValueError, "ghost_factor must not be negative");
        return -1;
    }
    if (!(protected_fraction >= 0.0 && protected_fraction <= 1.0)) {
        PyErr_SetString(PyExc_ValueError, "protected_fraction must be 0 to 1");
        return -1;
    }
    if (capacity < 1)
        capacity = 1;
    if (ghost_factor > PY_SSIZE_T_MAX / 4 / capacity) {
        PyErr_SetString(PyExc_OverflowError, "capacity * ghost_factor is too large");
        return -1;
    }
    if (self->table.entries == NULL && keyed_table_init(&self->table, sizeof(Entry)) < 0)
        return -1;
    forget_all(self);
    self->capacity = capacity;
    self->max_ghost = ghost_factor * capacity;
    /* As Python's int(protected_fraction * capacity): the same double, truncated. */
    self->max_protected = (Py_ssize_t)(protected_fraction * (double)capacity);
    self->low_reuse_first = (char)low_reuse_first;
    self->num_hits = 0.0;
    return 0;
}

static void
Shadow_dealloc(Shadow *self)
{
    if (self->table.entries != NULL)
        keyed_table_clear(&self->table);
    keyed_table_free(&self->table);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* 0 if the shadow may be changed now; else -1 with RuntimeError set. */
static int
check_ready(Shadow *self)
{
    if (self->table.entries == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ShadowSegmentedLRU.__init__ did not succeed");
        return -1;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the shadow is in the middle of an access");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(access_doc,
"access(hashes, low_reuse_hashes=()) -> int\n\n"
"One request's sampled hashes (distinct bytes objects), prefix first: count the held\n"
"ones as hits, then make all of them the most recent, the deepest least recent. New\n"
"hashes in low_reuse_hashes go to the low-reuse segment when this shadow evicts such\n"
"content first. Returns the number of hits. After an error (a hash that is not exact\n"
"bytes, or one raised by low_reuse_hashes) the shadow is whole but may hold part of the\n"
"request, uncounted.");

static PyObject *
Shadow_access(Shadow *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"hashes", "low_reuse_hashes", NULL};
    PyObject *hashes, *marks = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O", kwlist, &hashes, &marks))
        return NULL;
    if (check_ready(self) < 0)
        return NULL;
    /* Our own tuple: the caller's list may change while marks' __contains__ runs. */
    PyObject *sequence = PySequence_Tuple(hashes);
    if (sequence == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(sequence);
    PyObject **items = &PyTuple_GET_ITEM(sequence, 0);
    if (!self->low_reuse_first)
        marks = NULL;
    int protecting = self->max_protected > 0;
    /* With nothing protected, what would be promoted rejoins probation after the
     * request's new hashes: collected here, in order, until the loop ends. */
    Py_ssize_t *promoted = NULL, num_promoted = 0;
    if (!protecting && n > 0) {
        promoted = PyMem_Malloc(n * sizeof(Py_ssize_t));
        if (promoted == NULL) {
            Py_DECREF(sequence);
            return PyErr_NoMemory();
        }
    }
    Py_ssize_t num_hits = 0;
    int failed = 0;
    self->busy = 1;
    keyed_table_prefetch_keys(&self->table, items, n);
    for (Py_ssize_t k = n - 1; k >= 0; k--) {
        PyObject *key = items[k];
        if (!PyBytes_CheckExact(key)) {
            PyErr_Format(PyExc_TypeError, "a shadow's hashes must be bytes, not %.100s",
                         Py_TYPE(key)->tp_name);
            failed = 1;
            break;
        }
        Py_hash_t hash = PyObject_Hash(key);
        if (hash == -1 || keyed_table_make_room(&self->table) < 0) {
            failed = 1;
            break;
        }
        size_t slot;
        Py_ssize_t index = keyed_table_find(&self->table, key, hash, &slot);
        if (index == NONE) {
            int marked = 0;
            if (marks != NULL) {
                marked = PySequence_Contains(marks, key);
                if (marked < 0) {
                    failed = 1;
                    break;
                }
            }
            insert(self, key, hash, slot, marked ? LOW_REUSE : PROBATION);
            continue;
        }
        int list = entry(self, index)->list;
        if (list == PENDING)
            continue; /* a repeat within the request: already placed */
        if (list != GHOST)
            num_hits++;
        list_unlink(self, index);
        if (protecting)
            list_append(self, PROTECTED, index);
        else
            promoted[num_promoted++] = index;
    }
    for (Py_ssize_t k = 0; k < num_promoted; k++)
        list_append(self, PROBATION, promoted[k]);
    PyMem_Free(promoted);
    if (num_hits && !failed)
        self->num_hits += (double)num_hits;
    KeyedList *lists = self->lists;
    while (lists[PROTECTED].size > self->max_protected) {
        Py_ssize_t index = lists[PROTECTED].head;
        list_unlink(self, index);
        list_append(self, PROBATION, index);
    }
    Py_ssize_t num_evicted = lists[LOW_REUSE].size + lists[PROBATION].size
                             + lists[PROTECTED].size - self->capacity;
    if (num_evicted > 0) {
        for (Py_ssize_t k = 0; k < num_evicted; k++) {
            int from = lists[LOW_REUSE].size ? LOW_REUSE
                       : lists[PROBATION].size ? PROBATION : PROTECTED;
            Py_ssize_t index = lists[from].head;
            list_unlink(self, index);
            list_append(self, GHOST, index);
        }
        while (lists[GHOST].size > self->max_ghost)
            delete(self, lists[GHOST].head);
    }
    self->busy = 0;
    Py_DECREF(sequence); /* once no longer busy: freeing a refused key may run Python */
    if (failed)
        return NULL;
    return PyLong_FromSsize_t(num_hits);
}

static PyObject *
Shadow_forget(Shadow *self, PyObject *Py_UNUSED(ignored))
{
    if (check_ready(self) < 0)
        return NULL;
    forget_all(self);
    Py_RETURN_NONE;
}

static Py_ssize_t
Shadow_len(Shadow *self)
{
    return self->lists[LOW_REUSE].size + self->lists[PROBATION].size
           + self->lists[PROTECTED].size;
}

/* A list's keys, least recent first (the segments are views in Python; copies here). */
static PyObject *
Shadow_get_list(Shadow *self, void *closure)
{
    int list = (int)(Py_ssize_t)closure;
    PyObject *keys = PyList_New(0);
    if (keys == NULL || self->table.entries == NULL)
        return keys;
    for (Py_ssize_t index = self->lists[list].head; index != NONE;
         index = entry(self, index)->keyed.next) {
        if (PyList_Append(keys, entry(self, index)->keyed.key) < 0) {
            Py_DECREF(keys);
            return NULL;
        }
    }
    return keys;
}

static PyMethodDef Shadow_methods[] = {
    {"access", (PyCFunction)(void (*)(void))Shadow_access, METH_VARARGS | METH_KEYWORDS,
     access_doc},
    {"forget", (PyCFunction)Shadow_forget, METH_NOARGS, "Drop every key held and the ghost."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Shadow_members[] = {
    {"capacity", T_PYSSIZET, offsetof(Shadow, capacity), READONLY, NULL},
    {"max_ghost", T_PYSSIZET, offsetof(Shadow, max_ghost), READONLY, NULL},
    {"max_protected", T_PYSSIZET, offsetof(Shadow, max_protected), READONLY, NULL},
    {"low_reuse_first", T_BOOL, offsetof(Shadow, low_reuse_first), READONLY, NULL},
    {"num_hits", T_DOUBLE, offsetof(Shadow, num_hits), 0,
     "hits counted so far; the caller may scale it (decay)"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef Shadow_getset[] = {
    {"low_reuse", (getter)Shadow_get_list, NULL, "low-reuse keys, least recent first",
     (void *)(Py_ssize_t)LOW_REUSE},
    {"probation", (getter)Shadow_get_list, NULL, "probation keys, least recent first",
     (void *)(Py_ssize_t)PROBATION},
    {"protected", (getter)Shadow_get_list, NULL, "protected keys, least recent first",
     (void *)(Py_ssize_t)PROTECTED},
    {"ghost", (getter)Shadow_get_list, NULL, "evicted keys, least recent first",
     (void *)(Py_ssize_t)GHOST},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Shadow_as_sequence = {
    .sq_length = (lenfunc)Shadow_len,
};

static PyTypeObject ShadowType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "prefixcache.core.eviction._shadow_native.ShadowSegmentedLRU",
    .tp_basicsize = sizeof(Shadow),
    .tp_dealloc = (destructor)Shadow_dealloc,
    .tp_as_sequence = &Shadow_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ShadowSegmentedLRU(capacity, protected_fraction, low_reuse_first=False, "
              "ghost_factor=1)\n\nshadow.py's PythonShadowSegmentedLRU, in C (keys are exact bytes).",
    .tp_methods = Shadow_methods,
    .tp_members = Shadow_members,
    .tp_getset = Shadow_getset,
    .tp_init = (initproc)Shadow_init,
    .tp_new = Shadow_new,
};

/* -- the sample ----------------------------------------------------------------------- */

PyDoc_STRVAR(sampled_hashes_doc,
"sampled_hashes(hashes, threshold) -> list\n\n"
"The hashes (non-empty bytes) whose last byte is below threshold, in order.");

static PyObject *
sampled_hashes(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *hashes;
    int threshold;
    if (!PyArg_ParseTuple(args, "Oi", &hashes, &threshold))
        return NULL;
    PyObject *sequence = PySequence_Fast(hashes, "hashes must be a sequence of bytes");
    if (sequence == NULL)
        return NULL;
    PyObject *sampled = PyList_New(0);
    if (sampled == NULL) {
        Py_DECREF(sequence);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(sequence);
    PyObject **items = PySequence_Fast_ITEMS(sequence);
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *key = items[k];
        if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) == 0) {
            PyErr_SetString(PyExc_TypeError, "hashes must be non-empty bytes");
            goto error;
        }
        unsigned char last = (unsigned char)PyBytes_AS_STRING(key)[PyBytes_GET_SIZE(key) - 1];
        if (last < threshold && PyList_Append(sampled, key) < 0)
            goto error;
    }
    Py_DECREF(sequence);
    return sampled;
error:
    Py_DECREF(sequence);
    Py_DECREF(sampled);
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"sampled_hashes", sampled_hashes, METH_VARARGS, sampled_hashes_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "prefixcache.core.eviction._shadow_native",
    .m_doc = "adaptive's shadow caches and hash sample in C (see shadow.py).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__shadow_native(void)
{
    if (PyType_Ready(&ShadowType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    Py_INCREF(&ShadowType);
    if (PyModule_AddObject(module, "ShadowSegmentedLRU", (PyObject *)&ShadowType) < 0) {
        Py_DECREF(&ShadowType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
